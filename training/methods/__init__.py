"""All training methods, registered by name as they are imported (training.method_registry)."""

from training.methods import adapter, aot_ptuning, finetune, peft_tuners  # noqa: F401  (registration)
from training.method_registry import METHODS, MethodConfig, MethodError, MethodSpec, make_config, method_spec

__all__ = ["METHODS", "MethodConfig", "MethodError", "MethodSpec", "make_config", "method_spec"]
