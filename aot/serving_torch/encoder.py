"""The frozen encoder whose layer i sees H^i + rows[index, i]: one class for training, export and the torch engine."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from aot.serving.protocol import POOLINGS


def encoder_layers(encoder: nn.Module) -> nn.ModuleList:
    """The transformer layers of every supported encoder family (BERT, RoBERTa, XLM-R, DeBERTa-v2)."""
    return encoder.encoder.layer


def pool_states(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The final states [B, S, d] pooled each way in aot.serving.protocol.POOLINGS, [B, K, d]: training, export and
    both engines call this one function, so a task's head reads the same vector everywhere. No mask: no padding."""
    # Each state is weighted by 1 / (its input's token count) before the sum, so no partial sum exceeds the largest
    # state: a plain sum of a long input's large activations can overflow fp16 where the mean does not, and the fp16
    # ONNX and TensorRT graphs exported from this code run every op, this sum included, in fp16. So the states need
    # no fp32 copy (the torch engine's CUDA graphs run this on every batch).
    if attention_mask is None:
        mean = hidden.mean(1)
    else:
        mask = attention_mask[..., None].float()
        mean = (hidden * (mask / mask.sum(1, keepdim=True).clamp(min=1)).to(hidden.dtype)).sum(1)
    pooled = {"cls": hidden[:, 0], "mean": mean}
    return torch.stack([pooled[name] for name in POOLINGS], dim=1)


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The padding mask [B, S] as the additive mask [B, 1, 1, S] eager attention adds to its scores: 0 where a token
    is read, the dtype's lowest value where it is padding (what transformers' own mask helpers make), computed on the
    mask's device from the mask alone. Given a 4D mask, transformers uses it as it is: its own helpers branch on the
    mask's values in Python (a device-to-host sync; in some releases a host-to-device copy), which CUDA graph
    capture forbids, so the served engine passes this one instead."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class BiasedEncoder(nn.Module):
    """The frozen encoder whose layer i sees H^i + rows[index, i].

    `rows` is [N, L, d] (token-major, as stored by the exporter and held by the task pool) and `index` [B, S] says
    which of the N rows each token takes. Training passes the unique tokens of the batch; the exported graph
    receives both as inputs (or, in the dense bias interface, rows[index] itself: `forward_dense`); the torch engine
    passes the whole pool and each token's slot. One implementation serves all of them, so what is served adds
    exactly what training added.
    """

    def __init__(self, encoder: nn.Module, uses_token_type_ids: bool):
        super().__init__()
        self.encoder = encoder
        self.uses_token_type_ids = uses_token_type_ids
        layers = encoder_layers(encoder)
        # Python ints, so that the exported graph reshapes with constants rather than Shape ops.
        self.num_layers = len(layers)
        self.hidden_size = int(encoder.config.hidden_size)
        self._layer_bias: Callable[[int], torch.Tensor] | None = None  # layer i -> its [B, S, d] bias
        self._hooks = [layer.register_forward_pre_hook(partial(self._add_bias, i), with_kwargs=True)
                       for i, layer in enumerate(layers)]

    def remove_hooks(self) -> None:
        """Detach from the encoder (benchmarks share one encoder between methods)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _add_bias(self, i: int, module: nn.Module, args: tuple, kwargs: dict):
        if self._layer_bias is None:
            return None
        if args:
            hidden = args[0]
            return (hidden + self._layer_bias(i).to(hidden.dtype), *args[1:]), kwargs
        hidden = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": hidden + self._layer_bias(i).to(hidden.dtype)}

    def forward(self, input_ids, attention_mask, token_type_ids, rows, index) -> torch.Tensor:
        """`rows` [N, L, d]; `index` [B, S] picks each token's row. Returns the pooled states [B, K, d]."""
        return pool_states(self.states(input_ids, attention_mask, token_type_ids, rows, index), attention_mask)

    def states(self, input_ids, attention_mask, token_type_ids, rows, index) -> torch.Tensor:
        """As forward, but every token's final state [B, S, d] (what a token task's head reads)."""
        flat, base = rows.reshape(-1, self.hidden_size), index.long() * self.num_layers
        # One gather of the B*S rows layer i needs from the flat [N*L, d] table; the cast touches only those rows.
        return self._biased(lambda i: F.embedding(base + i, flat), input_ids, attention_mask, token_type_ids)

    def forward_dense(self, input_ids, attention_mask, token_type_ids, bias) -> torch.Tensor:
        """`bias` [B, S, L, d]: each token's row already gathered (rows[index]). Returns the final states [B, S, d]."""
        return self._biased(lambda i: bias[:, :, i], input_ids, attention_mask, token_type_ids)

    def _biased(self, layer_bias: Callable[[int], torch.Tensor], input_ids, attention_mask, token_type_ids):
        self._layer_bias = layer_bias
        try:
            return self.plain_states(input_ids, attention_mask, token_type_ids)
        finally:
            self._layer_bias = None

    def plain_states(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        """The encoder's final states [B, S, d] (with the bias forward or states set, else plain)."""
        extra = {"token_type_ids": token_type_ids} if self.uses_token_type_ids and token_type_ids is not None else {}
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state


def save_encoder(encoder: nn.Module, folder: Path) -> None:
    """The encoder's config and weights (safetensors), loadable by `load_encoder` without the training code."""
    encoder.save_pretrained(folder)


def load_encoder(folder: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """An encoder saved by `save_encoder`, frozen, in eval mode, with eager attention (what training runs)."""
    from transformers import AutoModel
    from transformers.utils import logging

    logging.disable_progress_bar()  # a served step's log is no terminal
    encoder = AutoModel.from_pretrained(str(folder), attn_implementation="eager", local_files_only=True,
                                        dtype=dtype)
    encoder.requires_grad_(False)
    return encoder.to(device).eval()
