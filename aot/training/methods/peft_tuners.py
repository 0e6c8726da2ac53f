"""Baselines that PEFT implements: LoRA, P-Tuning v2 (prefix tuning) and P-Tuning v1 (prompt encoder).

PEFT builds and owns the trainable parameters; the forward pass is called here so that token type ids reach the
encoder (PEFT's feature-extraction wrapper drops them) and pooling reads the real tokens under the real mask, not
the virtual ones.

peft is imported where a body is built, not with the module: it takes seconds to import (more than transformers),
and registering these methods, which every `aot` command that trains or loads a task does, must not pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from aot.training.backbone import Backbone
from aot.training.method_registry import MethodConfig, MethodError, MethodSpec, register


@dataclass
class LoraConfig(MethodConfig):
    """LoRA (Hu et al., 2021) on the query and value projections.

    rank: r (paper grid: 2, 4, 16, 32, 64). alpha: scaling numerator (scale = alpha / r). dropout: on the LoRA input.
    """

    method: ClassVar[str] = "lora"
    rank_field: ClassVar[str] = "rank"
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.1


@dataclass
class PrefixConfig(MethodConfig):
    """P-Tuning v2 (Liu et al., 2022): trainable key/value prefixes of length p in every layer.

    length: p (paper grid: 5, 10, 20, 50, 100).
    """

    method: ClassVar[str] = "prefix"
    rank_field: ClassVar[str] = "length"
    length: int = 20


@dataclass
class PromptConfig(MethodConfig):
    """P-Tuning v1 (Liu et al., 2021): p continuous prompt tokens before the input, produced by an MLP encoder.

    length: p (paper grid: 5, 10, 20, 50, 100). encoder_hidden: width of the prompt encoder MLP.
    """

    method: ClassVar[str] = "prompt"
    rank_field: ClassVar[str] = "length"
    length: int = 20
    encoder_hidden: int = 128


def _extra(backbone_uses_tt: bool, token_type_ids):
    return {"token_type_ids": token_type_ids} if backbone_uses_tt and token_type_ids is not None else {}


class LoraBody(nn.Module):
    def __init__(self, backbone: Backbone, config: LoraConfig):
        super().__init__()
        from peft import LoraConfig as PeftLoraConfig  # on first use: see the module's docstring
        from peft import get_peft_model

        peft_config = PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                     target_modules=list(backbone.architecture.lora_targets),
                                     task_type="FEATURE_EXTRACTION")
        self.peft = get_peft_model(backbone.encoder, peft_config)
        self.uses_token_type_ids = backbone.uses_token_type_ids

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.peft.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                   **_extra(self.uses_token_type_ids, token_type_ids))
        return out.last_hidden_state


class _PromptLearningBody(nn.Module):
    """Shared set-up of PEFT's prompt-learning methods on the bare encoder."""

    def __init__(self, backbone: Backbone, peft_config):
        super().__init__()
        from peft import get_peft_model  # on first use: see the module's docstring

        self.peft = get_peft_model(backbone.encoder, peft_config)
        self.encoder = backbone.encoder
        self.uses_token_type_ids = backbone.uses_token_type_ids
        self.length = peft_config.num_virtual_tokens
        max_positions = backbone.max_positions  # RoBERTa: max_position_embeddings - 2, not the raw count
        self.max_input_length = None if max_positions is None else max_positions - self.length

    def _check_length(self, input_ids):
        if self.max_input_length is not None and input_ids.shape[1] > self.max_input_length:
            raise MethodError(f"{input_ids.shape[1]} tokens + {self.length} virtual tokens exceed the encoder's "
                              f"{self.max_input_length + self.length} positions: lower --max-length")

    def _mask(self, attention_mask):
        ones = torch.ones(attention_mask.shape[0], self.length, dtype=attention_mask.dtype, device=attention_mask.device)
        return torch.cat([ones, attention_mask], dim=1)


class PrefixBody(_PromptLearningBody):
    def __init__(self, backbone: Backbone, config: PrefixConfig):
        from peft import PrefixTuningConfig  # on first use: see the module's docstring

        if backbone.architecture.model_type == "deberta-v2":
            raise MethodError("prefix tuning is not supported for deberta-v2 (its encoder takes no key/value cache)")
        super().__init__(backbone, PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=config.length))

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        self._check_length(input_ids)
        cache = self.peft.get_prompt(batch_size=input_ids.shape[0])
        out = self.encoder(input_ids=input_ids, attention_mask=self._mask(attention_mask), past_key_values=cache,
                           use_cache=False, **_extra(self.uses_token_type_ids, token_type_ids))
        return out.last_hidden_state


class PromptBody(_PromptLearningBody):
    def __init__(self, backbone: Backbone, config: PromptConfig):
        from peft import PromptEncoderConfig  # on first use: see the module's docstring

        super().__init__(backbone, PromptEncoderConfig(task_type="FEATURE_EXTRACTION",
                                                       num_virtual_tokens=config.length,
                                                       encoder_hidden_size=config.encoder_hidden))

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        self._check_length(input_ids)
        prompts = self.peft.get_prompt(batch_size=input_ids.shape[0])
        embeds = self.encoder.get_input_embeddings()(input_ids)
        extra = {}
        if self.uses_token_type_ids and token_type_ids is not None:
            extra["token_type_ids"] = torch.cat([torch.zeros_like(token_type_ids[:, :1]).expand(-1, self.length),
                                                 token_type_ids], dim=1)
        out = self.encoder(inputs_embeds=torch.cat([prompts.to(embeds.dtype), embeds], dim=1),
                           attention_mask=self._mask(attention_mask), **extra)
        return out.last_hidden_state[:, self.length:]  # the p prompts come first


register(MethodSpec("lora", LoraConfig, LoraBody, "LoRA on query/value (PEFT)", 5e-4))
register(MethodSpec("prefix", PrefixConfig, PrefixBody, "P-Tuning v2: prefix tuning (PEFT)", 5e-3))
register(MethodSpec("prompt", PromptConfig, PromptBody, "P-Tuning v1: prompt encoder (PEFT)", 5e-3))
