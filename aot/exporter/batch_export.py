"""`aot export task --repo REPO --batch FILE`: many tasks published into one repository together.

FILE holds JSON lines `{"task": DIR, "name": NAME}`. Every line is checked before any work (each bad one named by
its line number), the backbone and the validation engine are loaded once, each task is written as a single export
writes it and validated as one does (its served outputs against PyTorch), 32 tasks in one pass, and all of them are
published in ONE change of the store's index: a running server sees the whole batch from its next batch of
requests, or, if the export fails or is killed anywhere, none of it (every task stays as it was; the folders written
so far are removed, or collected as debris by the next export).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from aot.exporter.task_export import TaskExporter, TaskExportReport, WrittenTask
from aot.exporter.task_validation import ValidationError
from aot.serving.formats import check_keys, json_lines
from aot.serving.store.reader import StoreError

MAX_LISTED = 20  # bad lines named in one error
VALIDATED_TOGETHER = 32  # tasks whose served outputs are checked in one pass (TaskExporter.validate)


@dataclass(frozen=True)
class BatchLine:
    where: str  # FILE:LINE
    task: Path
    name: str


@dataclass
class BatchExportReport:
    tasks: list[TaskExportReport]
    seconds: float
    tasks_per_second: float


def read_batch(path: str | Path) -> list[BatchLine]:
    """The batch file's lines, each checked for its form (a JSON object with "task" and "name" strings, a task
    folder that exists, a name given once); every bad line is named in one StoreError."""
    lines, problems, seen = [], [], {}
    try:
        for line in json_lines(path):
            if line.item is None:
                problems.append(f"{line.where}: {line.error}")
                continue
            try:
                check_keys(line.item, {"task": str, "name": str}, line.where, error=StoreError)
            except StoreError as exc:
                problems.append(f"{exc} (expected {{\"task\": DIR, \"name\": NAME}})")
                continue
            name = line.item["name"]
            if name in seen:
                problems.append(f"{line.where}: task {name!r} is already published by line {seen[name]}")
                continue
            seen[name] = line.number
            if not Path(line.item["task"]).is_dir():
                problems.append(f"{line.where}: task folder {line.item['task']!r} does not exist")
                continue
            lines.append(BatchLine(line.where, Path(line.item["task"]), name))
    except OSError as exc:
        raise StoreError(f"cannot read the batch file {path}: {exc.strerror}") from None
    if not lines and not problems:
        raise StoreError(f"the batch file {path} holds no task (expected JSON lines {{\"task\": DIR, \"name\": NAME}})")
    _refuse(path, problems)
    return lines


def export_batch(repo_dir: str | Path, batch_file: str | Path, storage: str = "auto",
                 progress: bool = True, keep: int | None = None, allow_label_change: bool = False) -> BatchExportReport:
    """Export every task of the batch file and publish them in one change (module docstring); a line that would
    change its task's labels, kind or pair-ness is refused (the batch with it) unless `allow_label_change`."""
    start = time.perf_counter()
    lines = read_batch(batch_file)
    exporter = TaskExporter(repo_dir, progress=False, allow_label_change=allow_label_change)
    problems = []
    for line in lines:
        try:
            exporter.check(line.task, line.name, storage)
        except (StoreError, ValueError, OSError) as exc:
            problems.append(f"{line.where}: {exc}")
    _refuse(batch_file, problems)
    tasks_in_store = len(set(exporter.store.entries()) | {line.name for line in lines})
    written: list[WrittenTask] = []
    where = {line.name: line.where for line in lines}
    try:
        with tqdm(total=len(lines), desc="export tasks", unit="task", disable=not progress) as bar:
            for start_at in range(0, len(lines), VALIDATED_TOGETHER):
                for line in lines[start_at:start_at + VALIDATED_TOGETHER]:
                    try:
                        written.append(exporter.write_files(line.task, line.name, storage, tasks_in_store))
                    except (StoreError, ValueError, OSError) as exc:
                        raise StoreError(f"{line.where}: {exc}; nothing of the batch was published") from None
                chunk = written[start_at:]
                try:
                    exporter.validate(chunk)
                except ValidationError as exc:
                    raise StoreError(f"{where[exc.name]}: {exc.reason}; nothing of the batch was published") from None
                bar.update(len(chunk))
    except BaseException:
        for w in written:
            exporter.discard(w)
        raise
    reports = exporter.publish(written, keep)
    seconds = time.perf_counter() - start
    return BatchExportReport(reports, round(seconds, 2), round(len(reports) / seconds, 2))


def _refuse(path, problems: list[str]) -> None:
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise StoreError(f"the batch file {path} has {len(problems)} bad line(s); nothing was published:\n  "
                         f"{listed}{more}")
