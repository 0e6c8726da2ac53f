"""Task data: built-in real datasets, plain folders, GLUE and SuperGLUE folders.

    task        TaskSpec, TaskData, Example, the kinds of problem, DataError and DataWarning
    builtin     the real data sets that ship in packages (Rotten Tomatoes, BBC News, WNUT-16), split in code
    files       plain folders (CSV, JSONL) and the GLUE and SuperGLUE formats, checked whole (every bad row named)
    records     the rows of a JSONL, CSV or TSV file with their lines, and the checks of a row's shape
    kind_rows   the examples of the other kinds (multi-label, embedding) in a file's records
    conll       CoNLL files (word, tag) for token tasks
"""

from __future__ import annotations

from pathlib import Path

from aot.training.data.builtin import BUILTIN
from aot.training.data.files import detect_benchmark, load_benchmark_folder, load_folder
from aot.training.data.task import PROBLEMS, DataError, DataWarning, Example, TaskData, TaskSpec

__all__ = ["DataError", "DataWarning", "Example", "PROBLEMS", "TaskData", "TaskSpec", "load_task_data", "BUILTIN",
           "recorded_task_data"]
BUILTIN_PREFIX = "builtin:"  # how a built-in dataset's TaskData names its source (aot.training.data.builtin.split)


def load_task_data(data: str, labels: list[str] | None = None, metric: str | None = None,
                   problem: str | None = None) -> TaskData:
    """`data` is a built-in dataset name or a folder (plain, GLUE or SuperGLUE). `problem` (PROBLEMS: the task's
    kind) decides a plain folder's kind; a built-in or benchmark task has its own, which it must match."""
    if problem is not None and problem not in PROBLEMS:
        raise DataError(f"problem {problem!r}: expected one of {', '.join(PROBLEMS)}")
    folder = Path(data)
    if data in BUILTIN:
        task = BUILTIN[data]()
    elif not folder.is_dir():
        raise DataError(f"data {data!r} is neither a folder nor a built-in dataset ({', '.join(BUILTIN)})")
    elif (benchmark := detect_benchmark(folder)) is not None:
        task = load_benchmark_folder(folder, benchmark)
    else:
        return load_folder(folder, labels=labels, metric=metric, problem=problem)
    kind = task.spec.kind
    if problem not in (None, kind):
        raise DataError(f"--problem {problem}: {task.spec.name} is a {kind} task")
    return task


def recorded_task_data(source: str, spec: TaskSpec) -> TaskData:
    """The data a task artifact records it was trained on (its `training.data` field: `builtin:NAME` or a folder), read
    as the task's kind: its labels, metric and problem."""
    name = source[len(BUILTIN_PREFIX):] if source.startswith(BUILTIN_PREFIX) else source
    return load_task_data(name, labels=None if spec.labels is None else list(spec.labels), metric=spec.metric,
                          problem=spec.kind)
