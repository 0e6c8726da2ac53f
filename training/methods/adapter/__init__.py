"""Houlsby adapters (a baseline; PEFT has no bottleneck adapters)."""

from training.methods.adapter.config import AdapterConfig
from training.methods.adapter.model import AdapterBody, build_adapter
from training.method_registry import MethodSpec, register

register(MethodSpec("adapter", AdapterConfig, build_adapter, "Houlsby adapters", 5e-4))

__all__ = ["AdapterConfig", "AdapterBody"]
