"""A published version loaded as a server loads it: what `aot export verify` and `aot export repair` check beyond the
store's own digests. The store cannot import the served loader (aot.serving.tasks imports the store), so they are
handed this check (aot.serving.store.writer.VersionCheck)."""

from __future__ import annotations

from pathlib import Path

from aot.serving.tasks import load_task_version


def loads_as_served(folder: Path, version: str, store_root: Path, digests: dict[str, str] | None) -> None:
    """Load every part of the version (task.json, head, table or factors) and hash a fused table whole; raises
    OSError or ValueError (aot.serving.store.reader.StoreError) when it cannot serve."""
    load_task_version(folder, version, store_root, "all", digests).check_table()
