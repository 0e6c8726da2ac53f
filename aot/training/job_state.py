"""What a job keeps beside its artifacts so that a killed job resumes: the folder DIR/.aot-job of its out folder.

    tasks/NAME.json        each task's record: trained (its summary), or failed (why, at which step); with the
                           fingerprint of its spec (aot.training.job_spec.TaskSpec.fingerprint)
    checkpoints/NAME.pt    an unfinished task's last checkpoint (TaskRun.state_dict and its random stream), taken at
                           each of its evaluations and every `checkpoint_seconds` of the job
    export.jsonl           the trained tasks as `aot export task --batch` reads them ({"task": DIR/NAME, "name"})

One file per task, whichever process trained it: the ranks of a sharded job write into one folder, and a job resumed
with another number of ranks finds every task's state. Each file is written whole or not at all (a temporary file
renamed over it). A task's name never starts with '.', so the folder is never a task's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

STATE_DIR = ".aot-job"


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class JobFolder:
    """The job state of the out folder `out`."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.root = self.out / STATE_DIR

    def exists(self) -> bool:
        return self.root.is_dir()

    def reset(self) -> None:
        """Forget every record and checkpoint (a job started again with --overwrite)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def record(self, name: str) -> dict | None:
        path = self.root / "tasks" / f"{name}.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def write_record(self, name: str, record: dict) -> None:
        text = json.dumps(record, indent=2, ensure_ascii=False) + "\n"
        _atomic_write(self.root / "tasks" / f"{name}.json", lambda p: p.write_text(text, encoding="utf-8"))

    def records(self) -> dict[str, dict]:
        folder = self.root / "tasks"
        names = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
        return {name: record for name in names if (record := self.record(name)) is not None}

    def checkpoint(self, name: str) -> dict | None:
        """The task's last checkpoint, or None (none, or unreadable: the task then starts again)."""
        path = self.root / "checkpoints" / f"{name}.pt"
        if not path.is_file():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged checkpoint costs the task its progress, not the job
            return None

    def save_checkpoint(self, name: str, state: dict) -> None:
        _atomic_write(self.root / "checkpoints" / f"{name}.pt", lambda p: torch.save(state, p))

    def drop_checkpoint(self, name: str) -> None:
        (self.root / "checkpoints" / f"{name}.pt").unlink(missing_ok=True)

    def write_export(self) -> Path:
        """export.jsonl: every task recorded trained whose artifact is there, by name."""
        lines = [json.dumps({"task": str(self.out / name), "name": name}, ensure_ascii=False) + "\n"
                 for name, record in self.records().items()
                 if record.get("status") == "trained" and (self.out / name).is_dir()]
        path = self.root / "export.jsonl"
        _atomic_write(path, lambda p: p.write_text("".join(lines), encoding="utf-8"))
        return path
