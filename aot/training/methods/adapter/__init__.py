"""Houlsby adapters (a baseline; PEFT has no bottleneck adapters): config (AdapterConfig), layer (the
bottleneck, HoulsbyAdapter), model (the body, build_adapter)."""

from aot.training.method_registry import MethodSpec, register
from aot.training.methods.adapter.config import AdapterConfig
from aot.training.methods.adapter.model import AdapterBody, build_adapter

register(MethodSpec("adapter", AdapterConfig, build_adapter, "Houlsby adapters", 5e-4))

__all__ = ["AdapterConfig", "AdapterBody"]
