"""Task data: built-in real datasets, plain folders, GLUE and SuperGLUE folders."""

from __future__ import annotations

from pathlib import Path

from training.data.builtin import BUILTIN
from training.data.files import detect_benchmark, load_benchmark_folder, load_folder
from training.data.task import DataError, Example, TaskData, TaskSpec

__all__ = ["DataError", "Example", "TaskData", "TaskSpec", "load_task_data", "BUILTIN"]


def load_task_data(data: str, labels: list[str] | None = None, metric: str | None = None) -> TaskData:
    """`data` is a built-in dataset name or a folder (plain, GLUE or SuperGLUE)."""
    if data in BUILTIN:
        return BUILTIN[data]()
    folder = Path(data)
    if not folder.is_dir():
        raise DataError(f"data {data!r} is neither a folder nor a built-in dataset ({', '.join(BUILTIN)})")
    benchmark = detect_benchmark(folder)
    if benchmark is not None:
        return load_benchmark_folder(folder, benchmark)
    return load_folder(folder, labels=labels, metric=metric)
