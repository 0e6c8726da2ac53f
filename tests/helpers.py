"""Shared set-up for export and serving tests: tiny tasks and repositories."""

from __future__ import annotations

from pathlib import Path

from exporter.backbone_export import export_backbone
from exporter.task_export import export_task
from training.api import train_task

QUICK = dict(batch_size=16, epochs=3, patience=3, max_length=32, progress=False)


def train_tiny_task(model_dir: Path, data_dir: Path, out: Path, method: str = "fc", seed: int = 0, **kw) -> Path:
    # lr 3e-3, inside the paper's range: at 1e-2 (or 5e-3) tiny Kron tasks grow rows so large that their fp16 table misses
    # the exporter's 1e-3 logit tolerance (it then refuses them, as it should).
    train_task(model=str(model_dir), data=str(data_dir), method=method, out=str(out), lr=3e-3, seed=seed,
               **{**QUICK, **kw})
    return out


def make_repository(model_dir: Path, repo: Path, tasks: dict[str, tuple[Path, str]], **options) -> Path:
    """A repository with `tasks`: name -> (artifact, storage)."""
    from serving.repository import ServingOptions

    export_backbone(str(model_dir), repo, ServingOptions(**options) if options else None)
    for name, (artifact, storage) in tasks.items():
        export_task(artifact, repo, name, storage, progress=False)
    return repo


# Every model of a repository's CPU configs: the fused `aot` / `vanilla` clients call, and the GPU ensembles' separate
# steps, which a CPU server loads only when asked (tests call them directly: they run the same stages)
WITH_STEPS = ("aot", "vanilla", "task_list", "tokenizer", "backbone", "backbone_vanilla", "head")


def serve_for_tests(request, repo: Path, load: tuple[str, ...] | None = None):
    """A LocalServer for a test module's fixture (yield from it); prints the server's log when a test failed.
    `load`: the models to load (default: what the CPU configs serve clients)."""
    from aot.server import LocalServer

    failed_before = request.session.testsfailed
    server = LocalServer(repo, load=load).start()
    yield server
    if request.session.testsfailed > failed_before:  # before stop(), which removes a temporary log
        print(f"\n--- tritonserver log ({server.log_path}) ---\n{server.log_tail(80)}")
    server.stop()
