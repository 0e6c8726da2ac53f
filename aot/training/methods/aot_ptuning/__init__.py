"""AoT P-Tuning (Gavrilov & Balagansky, 2023): FC and Kronecker reparametrizations of P.

    config       FCConfig, KronConfig, AotConfig (the PEFT-style config)
    layer        FCPrompt, KronPrompt: P's rows from the factors
    model        the body that adds P^i[x] before every layer (BiasedEncoder), build_fc, build_kron
    peft_model   AotModel and get_aot_model: the PEFT-shaped API
"""

from aot.training.method_registry import MethodSpec, register
from aot.training.methods.aot_ptuning.config import FCConfig, KronConfig
from aot.training.methods.aot_ptuning.layer import FCPrompt, KronPrompt
from aot.training.methods.aot_ptuning.model import AotBody, BiasedEncoder, build_fc, build_kron

register(MethodSpec("fc", FCConfig, build_fc, "AoT P-Tuning, FC reparametrization", 1e-3, shared_backbone=True))
register(MethodSpec("kron", KronConfig, build_kron, "AoT P-Tuning, Kronecker reparametrization", 1e-3,
                      shared_backbone=True))

__all__ = ["FCConfig", "KronConfig", "FCPrompt", "KronPrompt", "AotBody", "BiasedEncoder"]
