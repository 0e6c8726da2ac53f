"""All training methods, registered by name (see base.METHODS)."""

from training.methods import adapter, aot_ptuning, finetune, peft_tuners  # noqa: F401  (registration)
from training.methods.base import METHODS, MethodConfig, MethodError, MethodSpec, make_config, method_spec

__all__ = ["METHODS", "MethodConfig", "MethodError", "MethodSpec", "make_config", "method_spec"]
