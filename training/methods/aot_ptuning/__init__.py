"""AoT P-Tuning (Gavrilov & Balagansky, 2023): FC and Kronecker reparametrizations of P."""

from training.methods.aot_ptuning.config import FCConfig, KronConfig
from training.methods.aot_ptuning.layer import FCPrompt, KronPrompt
from training.methods.aot_ptuning.model import AotBody, BiasedEncoder, build_fc, build_kron
from training.method_registry import MethodSpec, register

register(MethodSpec("fc", FCConfig, build_fc, "AoT P-Tuning, FC reparametrization", 1e-3, shared_backbone=True))
register(MethodSpec("kron", KronConfig, build_kron, "AoT P-Tuning, Kronecker reparametrization", 1e-3,
                      shared_backbone=True))

__all__ = ["FCConfig", "KronConfig", "FCPrompt", "KronPrompt", "AotBody", "BiasedEncoder"]
