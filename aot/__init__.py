"""AoT P-Tuning: the Python API (PEFT-shaped: AotConfig, get_aot_model, AotModel, MultiTaskModel, PairCollator; needs
the [train] extra), the `aot` command, the gRPC client and the local server launcher."""

__version__ = "0.1.0"

# name -> (module, attribute), imported on first use: `import aot` stays cheap for the CLI and the client.
_LAZY = {
    "Client": ("aot.client", "Client"),
    "InferenceError": ("aot.errors", "InferenceError"),
    "TaskNotFound": ("aot.errors", "TaskNotFound"),
    "InvalidInput": ("aot.errors", "InvalidInput"),
    "TaskUnavailable": ("aot.errors", "TaskUnavailable"),
    "Unavailable": ("aot.errors", "Unavailable"),
    "PermissionDenied": ("aot.errors", "PermissionDenied"),
    "LocalServer": ("aot.server", "LocalServer"),
    "AotConfig": ("training.methods.aot_ptuning.config", "AotConfig"),
    "AotModel": ("training.methods.aot_ptuning.peft_model", "AotModel"),
    "get_aot_model": ("training.methods.aot_ptuning.peft_model", "get_aot_model"),
    "MultiTaskModel": ("training.multitask", "MultiTaskModel"),
    "PairCollator": ("training.pair_collator", "PairCollator"),
    "model_path": ("training.backbone", "resolve_model_path"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(name)
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)


__all__ = [*_LAZY, "__version__"]
