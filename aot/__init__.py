"""AoT P-Tuning: many tasks on one frozen encoder. The one top-level package; its rooms, top to bottom (each imports
only those below it: pyproject.toml [tool.importlinter], tests/test_imports.py):

    benchmarks        `aot bench`: the measurements behind docs/benchmarks.md (a plugin of the command)
    cli               the `aot` command
    local             servers started on this machine: tritonserver, a fleet behind HAProxy, SeaweedFS
    client            the gRPC client (`from aot import Client`): no torch
    exporter          a trained task into a served repository: the backbone, the configs, each task's version
                      folder, validated and published through the store's writer (serving.store)
    training          tasks trained on a frozen encoder: AoT P-Tuning (FC, Kronecker) and the baselines
    model_repository  the Triton python models (templates an export copies, never imports; thin adapters over
                      serving and, for the torch engine and the GPU pool, serving_torch)
    serving_torch     the torch engine of the served steps
    serving           the ground floor the Triton steps run, torch-free: the request path, the task store read and
                      written in one room (serving.store) and the supervision of a running server (serving.supervision)
    settings          every AOT_* environment variable, its type, default and meaning (under everything)

The Python API below is imported on first use (PEFT-shaped: AotConfig, get_aot_model, AotModel, MultiTaskModel,
PairCollator need the [train] extra), so that `import aot` stays cheap for the command, the client and the
Triton steps, which import aot.serving.
"""

__version__ = "0.1.0"

# name -> (module, attribute), imported on first use: `import aot` stays cheap for the CLI and the client.
_LAZY = {
    "Client": ("aot.client.client", "Client"),
    "InferenceError": ("aot.client.errors", "InferenceError"),
    "TaskNotFound": ("aot.client.errors", "TaskNotFound"),
    "InvalidInput": ("aot.client.errors", "InvalidInput"),
    "TaskUnavailable": ("aot.client.errors", "TaskUnavailable"),
    "Unavailable": ("aot.client.errors", "Unavailable"),
    "PermissionDenied": ("aot.client.errors", "PermissionDenied"),
    "LocalServer": ("aot.local.server", "LocalServer"),
    "AotConfig": ("aot.training.methods.aot_ptuning.config", "AotConfig"),
    "AotModel": ("aot.training.methods.aot_ptuning.peft_model", "AotModel"),
    "get_aot_model": ("aot.training.methods.aot_ptuning.peft_model", "get_aot_model"),
    "MultiTaskModel": ("aot.training.multitask", "MultiTaskModel"),
    "PairCollator": ("aot.training.pair_collator", "PairCollator"),
    "model_path": ("aot.training.backbone", "resolve_model_path"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(name)
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)


__all__ = [*_LAZY, "__version__"]
