"""The int8 CPU graph's arithmetic in PyTorch, for re-fitting a task to the backbone it will be served on.

aot.exporter.quantize records what an int8 repository quantizes (`aot_repository.json`: `quantization`); this emulates
the same: every linear layer of the encoder's layers (the fused Attention's Q, K, V projections and every other
MatMul of the layers) takes int8 weights, symmetric, one scale per output channel (|w|max / 127), and quantizes its
input to uint8 at run time as ONNX Runtime's DynamicQuantizeLinear does (range [min(0, x), max(0, x)], scale
range / 255, zero point rounded half to even), one range per sequence over its real tokens (the int8 graph runs
one request at a time, without padding). Gradients pass the rounding straight through (STE), so the task's
trainable parts (P and its head) learn against the int8 backbone's behaviour while the backbone stays frozen.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from aot.training.backbone import encoder_layers

# What the int8 graph quantizes (aot.exporter.quantize applies it; a repository records it; re-fitting checks it)
QUANTIZATION = {"method": "onnxruntime-dynamic", "ops": ["MatMul", "Attention"], "weights": "int8-symmetric-per-channel",
            "activations": "uint8-asymmetric-per-tensor-dynamic", "runs": "per-request"}


def quantized_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8, symmetric, one scale per output channel (a row of nn.Linear's weight), dequantized."""
    scale = (weight.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(weight.dtype).tiny)
    return torch.clamp(torch.round(weight / scale), -127, 127) * scale


def quantize_activations(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """DynamicQuantizeLinear then dequantized, one range per sequence (x [B, S, d]) over its real tokens (`mask`
    [B, S]); the gradient passes straight through."""
    with torch.no_grad():
        if mask is None:
            low, high = x.amin(dim=(1, 2)), x.amax(dim=(1, 2))
        else:
            real = mask.to(torch.bool)[..., None]
            low = torch.where(real, x, torch.full_like(x, float("inf"))).amin(dim=(1, 2))
            high = torch.where(real, x, torch.full_like(x, float("-inf"))).amax(dim=(1, 2))
        low, high = low.clamp(max=0.0), high.clamp(min=0.0)
        scale = ((high - low) / 255.0).clamp_min(torch.finfo(x.dtype).tiny)[:, None, None]
        zero = torch.clamp(torch.round(-low[:, None, None] / scale), 0, 255)
        q = (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale
    return x + (q - x).detach()


class Int8Linear(nn.Module):
    """nn.Linear as the int8 graph computes it: quantized input and weight, fp32 bias."""

    def __init__(self, linear: nn.Linear, masks: dict):
        super().__init__()
        self.linear = linear
        self.masks = masks  # {"mask": the current batch's attention mask}, set by emulate_int8's hook
        self.register_buffer("weight_q", quantized_weight(linear.weight.detach()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.masks.get("mask")
        if x.dim() != 3 or mask is None or mask.shape != x.shape[:2]:
            mask = None
        return nn.functional.linear(quantize_activations(x, mask), self.weight_q, self.linear.bias)


@contextmanager
def emulate_int8(encoder: nn.Module):
    """Within the block, `encoder` (frozen) computes as the int8 graph does; its linear layers are restored after."""
    masks: dict = {}
    replaced = []
    for layer in encoder_layers(encoder):
        for name, module in list(layer.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, child_name, Int8Linear(child, masks))
                    replaced.append((module, child_name, child))

    def remember_mask(_module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1:
            mask = args[1]
        masks["mask"] = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    hook = encoder.register_forward_pre_hook(remember_mask, with_kwargs=True)
    try:
        yield encoder
    finally:
        hook.remove()
        for module, child_name, child in replaced:
            setattr(module, child_name, child)
