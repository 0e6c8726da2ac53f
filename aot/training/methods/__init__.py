"""All training methods, registered by name as they are imported (aot.training.method_registry). Each method's
folder follows PEFT's tuners: config (the fields, with their help), model (the body built from it), layer.

    aot_ptuning   AoT P-Tuning, FC and Kronecker (its PEFT-style AotModel: peft_model)
    adapter       Houlsby adapters (a baseline; PEFT has no bottleneck adapters)
    peft_tuners   the PEFT baselines: LoRA, P-Tuning v2 (prefix), P-Tuning v1 (prompt encoder)
    finetune      full fine-tuning and BitFit
"""

from aot.training.method_registry import METHODS, MethodConfig, MethodError, MethodSpec, make_config, method_spec
from aot.training.methods import adapter, aot_ptuning, finetune, peft_tuners  # noqa: F401  (registration)

__all__ = ["METHODS", "MethodConfig", "MethodError", "MethodSpec", "make_config", "method_spec"]
