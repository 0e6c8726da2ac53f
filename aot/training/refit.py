"""Re-fitting a task to an int8 backbone (`aot train --fit-to REPO --task DIR`): continue its AoT training with the
frozen encoder computing as the repository's int8 graph does (aot.training.quantized), so that its P and head learn to
serve on the backbone they will run on. An AoT task trains only its own parts, so fitting one task costs nothing to
the others sharing the backbone.

The fitted artifact records what it was fitted to and the fp32 score of the task it started from (`training.fit_to`
in config.json), which the accuracy gate holds its served score against (aot.exporter.accuracy_gate).
"""

from __future__ import annotations

import time
from pathlib import Path

from aot.serving.repository import read_repository
from aot.training.artifact import ArtifactError, check_fingerprint, save_task
from aot.training.backbone import load_backbone
from aot.training.data import recorded_task_data
from aot.training.factory import load_task
from aot.training.method_registry import method_spec
from aot.training.quantized import QUANTIZATION, emulate_int8
from aot.training.trainer import TrainConfig, encode, evaluate, resolve_device, train


def fit_task(task_dir: str | Path, repo_dir: str | Path, out: str | Path, config: TrainConfig,
             progress: bool = True) -> dict:
    """Fit the task artifact `task_dir` to the int8 backbone of repository `repo_dir` and save it to `out`. Returns
    the summary metrics.json holds: the fp32 score it started from, its emulated int8 dev score before and after."""
    repo = read_repository(repo_dir)
    if repo.record.cpu_precision != "int8":
        raise ArtifactError(f"{repo.path} serves {repo.record.cpu_precision} on CPU: there is no int8 backbone to fit "
                            "to (export one with aot export backbone --precision int8)")
    if repo.record.quantization != QUANTIZATION:
        raise ArtifactError(f"{repo.path} was quantized as {repo.record.quantization}; this version emulates "
                            f"{QUANTIZATION}: re-export the backbone with this version")
    artifact, model, backbone = load_task(task_dir, load_backbone(repo.model))
    check_fingerprint(artifact, repo.fingerprint, f"{repo.model} (repository {repo.path})")
    method = artifact.config["method"]["method"]
    if not method_spec(method).shared_backbone:
        raise ArtifactError(f"task {task_dir} was trained with method {method!r}; only AoT tasks (fc, kron) are served "
                            "on the shared backbone")
    spec = artifact.spec
    source = artifact.config.get("training", {}).get("data")
    if not source:
        raise ArtifactError(f"task {task_dir} records no training data to fit it on")
    data = recorded_task_data(source, spec)
    tokenizer, device = backbone.tokenizer, resolve_device(config.device)
    dev = encode(tokenizer, data.dev, spec, artifact.max_length)
    pad = tokenizer.pad_token_id or 0

    def dev_score() -> float:
        return evaluate(model.to(device), dev, spec, pad, device)

    fp32 = dev_score()
    start = time.perf_counter()
    with emulate_int8(model.body.biased.encoder):
        before = dev_score()
        original = model.trainable_state()
        config.max_length = artifact.max_length
        result = train(model, data, tokenizer, config, progress=progress)
        if result.dev_score < before:  # fitting found nothing better: keep the task as it was
            model.load_trainable_state(original)
        elif result.spec is not None:  # what the fit tuned on dev with its weights (a multi-label threshold)
            spec = result.spec
        after = max(result.dev_score, before)
    fitted_fp32 = dev_score()
    model.to("cpu")
    fit_to = {"repository": str(repo.path.resolve()), "fingerprint": repo.fingerprint,
              "quantization": QUANTIZATION, "task": str(Path(task_dir).resolve()), "fp32_dev": fp32}
    training = {**artifact.config.get("training", {}), "fit": config.to_json(), "fit_to": fit_to}
    metrics = {"task": spec.name, "method": method, "pooling": model.pooling, "metric": spec.metric,
               "dev": fitted_fp32, "fp32_dev_before_fit": fp32, "int8_dev_before_fit": before,
               "int8_dev": after, "best_step": result.best_step, "steps": result.steps, "stopped": result.stopped,
               "train_seconds": round(time.perf_counter() - start, 2), "history": result.history}
    save_task(out, model, artifact.config["backbone"], artifact.method_config, spec, artifact.max_length, training,
              metrics)
    return {k: v for k, v in metrics.items() if k != "history"} | {"out": str(out)}
