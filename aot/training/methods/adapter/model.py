"""Adapters attached with forward hooks to the sub-layer outputs named by the architecture table."""

from __future__ import annotations

from torch import nn

from aot.training.backbone import Backbone
from aot.training.methods.adapter.config import AdapterConfig
from aot.training.methods.adapter.layer import HoulsbyAdapter


class AdapterBody(nn.Module):
    def __init__(self, backbone: Backbone, config: AdapterConfig):
        super().__init__()
        self.encoder = backbone.encoder
        self.uses_token_type_ids = backbone.uses_token_type_ids
        self.adapters = nn.ModuleList()
        for layer in backbone.architecture.layers(self.encoder):
            for site in backbone.architecture.adapter_sites:
                adapter = HoulsbyAdapter(backbone.hidden_size, config.rank)
                layer.get_submodule(site).register_forward_hook(lambda m, a, out, ad=adapter: ad(out))
                self.adapters.append(adapter)
            if config.train_layer_norms:
                for name, param in layer.named_parameters():
                    if "LayerNorm" in name or "layer_norm" in name:
                        param.requires_grad_(True)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        extra = {"token_type_ids": token_type_ids} if self.uses_token_type_ids and token_type_ids is not None else {}
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        return hidden


def build_adapter(backbone: Backbone, config: AdapterConfig) -> AdapterBody:
    return AdapterBody(backbone, config)
