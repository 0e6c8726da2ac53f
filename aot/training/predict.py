"""Running trained tasks in PyTorch: the reference every served answer is compared with, and `aot predict`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from aot.serving.formats import JsonLine, json_lines
from aot.serving.tokenization import given_pair, is_blank, pair_mismatch
from aot.training.artifact import TaskArtifact, read_task
from aot.training.backbone import Backbone, load_backbone
from aot.training.data.task import Example
from aot.training.factory import load_task
from aot.training.kinds import Encoded, kind_for
from aot.training.method_registry import method_spec
from aot.training.model import TaskModel
from aot.training.multitask import MultiTaskModel


class Predictor:
    def __init__(self, artifact: TaskArtifact, model: TaskModel, backbone: Backbone, device: str = "cpu"):
        self.artifact, self.model, self.backbone = artifact, model, backbone
        self.device = torch.device(device)
        self.model.to(self.device)

    @classmethod
    def load(cls, task_dir: str | Path, backbone: Backbone | None = None, device: str = "cpu") -> "Predictor":
        return cls(*load_task(task_dir, backbone), device=device)

    def outputs(self, texts: list[str], pairs: list[str | None] | None = None) -> tuple[object, Encoded]:
        """The kind's predictions of the texts (aot.training.kinds), and the texts as it encoded them."""
        spec = self.artifact.spec
        examples = [Example(t, None, p) for t, p in zip(texts, pairs or [None] * len(texts), strict=True)]
        kind = kind_for(spec)
        encoded = kind.encode(self.backbone.tokenizer, examples, spec, self.artifact.max_length)
        return kind.predict(self.model, encoded, self.backbone.tokenizer.pad_token_id or 0, self.device), encoded

    def logits(self, texts: list[str], pairs: list[str | None] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """What the head computes for each text: [N, n] logits (the score, for regression), [N, d] vectors
        (embedding), or per text its tokens' logits [S, n] (tokens)."""
        predictions, _ = self.outputs(texts, pairs)
        return predictions[0] if self.artifact.spec.kind_spec.pair_examples else predictions

    def predict(self, texts: list[str], pairs: list[str | None] | None = None, name: str | None = None) -> list[dict]:
        """The answer of the task's kind for each text (aot.serving.kinds), its task's name first (`name`; default:
        the one it was trained as)."""
        spec = self.artifact.spec
        predictions, encoded = self.outputs(texts, pairs)
        return [{"task": name or spec.name, **a} for a in kind_for(spec).answers(spec, predictions, encoded)]


# --- aot predict ------------------------------------------------------------------------------------------------------

def task_folders(items: list[str]) -> dict[str, Path]:
    """`--task` values, `DIR` or `NAME=DIR`, as name -> folder (a bare folder is named after itself)."""
    tasks: dict[str, Path] = {}
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or os.path.isdir(item):
            name, folder = Path(item).resolve().name, item
        if not name or name in tasks:
            raise ValueError(f"--task {item!r}: the name {name!r} is empty or given twice: name tasks NAME=DIR")
        tasks[name] = Path(folder)
    return tasks


Line = tuple[int, dict]  # (line number, {"text", "text_pair", "task"[, "id"]})


def read_input_lines(path: str, tasks: dict[str, Path]) -> tuple[list[Line], list[tuple[int, str]]]:
    """The good lines of a JSONL file (`-`: standard input) and, for each bad one, (line number, why). Blank lines
    are skipped. A file that cannot be opened is one OSError; a line that is not UTF-8, not a JSON object, lacks a
    string "text", names no loaded task or is one the server refuses (check_line) fails alone."""
    return _checked_lines(json_lines(path), tasks)


def text_lines(texts: list[str], pair: str | None, tasks: dict[str, Path]) -> tuple[list[Line], list[tuple[int, str]]]:
    """TEXT arguments of the one task (each with `pair`), read as read_input_lines reads a file's lines: numbered
    from 1, each checked alone."""
    return _checked_lines((JsonLine("<arguments>", number, {"text": text, "text_pair": pair})
                           for number, text in enumerate(texts, 1)), tasks)


def _checked_lines(lines: Iterable[JsonLine], tasks: dict[str, Path]) -> tuple[list[Line], list[tuple[int, str]]]:
    default = next(iter(tasks)) if len(tasks) == 1 else None
    pairs = {name: read_task(folder).spec.has_pair for name, folder in tasks.items()}
    good: list[Line] = []
    bad: list[tuple[int, str]] = []
    for line in lines:
        try:
            good.append((line.number, check_line(_request(line, tasks, default), pairs)))
        except ValueError as exc:
            bad.append((line.number, str(exc)))
    return good, bad


def check_line(item: dict, pairs: dict[str, bool]) -> dict:
    """`item`, if the server would answer it (the same rules: aot.serving.tokenization's is_blank, given_pair and
    pair_mismatch), its blank pair dropped as served; otherwise a ValueError naming the refusal. `pairs`: each
    task's name -> whether it was trained on text pairs."""
    if is_blank(item["text"]):
        raise ValueError("text is empty (or only whitespace, control or zero-width characters)")
    pair = given_pair(item["text_pair"])
    if pair_mismatch(pairs[item["task"]], pair is not None):
        raise ValueError(f"task {item['task']!r} was trained on " + (
            "single texts: give no text_pair" if pair is not None else "text pairs: give text_pair too"))
    return {**item, "text_pair": pair}


def _request(line: JsonLine, tasks: dict[str, Path], default: str | None) -> dict:
    """The line as {"text", "text_pair", "task"[, "id"]}."""
    item = line.item
    if item is None:
        raise ValueError(line.error)
    if not isinstance(item.get("text"), str):
        raise ValueError('expected "text", a string')
    pair = item.get("text_pair")
    if pair is not None and not isinstance(pair, str):
        raise ValueError('"text_pair" must be a string')
    task = item.get("task", default)
    if task is None:
        raise ValueError(f'no "task": with several --task, each line names one of {", ".join(tasks)}')
    if task not in tasks:
        raise ValueError(f"unknown task {str(task)[:100]!r}: expected one of {', '.join(tasks)}")
    return {"text": item["text"], "text_pair": pair, "task": task} | ({"id": item["id"]} if "id" in item else {})


def predict_lines(tasks: dict[str, Path], lines: list[Line], model: str | None, batch_size: int = 32,
                  device: str = "cpu", on_batch: Callable[[int], None] | None = None) -> dict[int, dict]:
    """Answers by line number (with each line's "id" first when it has one), computed on `device`. AoT tasks run
    together in a MultiTaskModel; a task of another method (it changes the encoder) runs alone, in a Predictor.
    `on_batch(n)`: after every n lines answered (progress)."""
    methods = {name: read_task(folder).method_config.method for name, folder in tasks.items()}
    shared = {name: method_spec(method).shared_backbone for name, method in methods.items()}
    if not lines:
        return {}
    texts, pairs, names = ([item[k] for _, item in lines] for k in ("text", "text_pair", "task"))
    if all(shared.values()):
        rows = MultiTaskModel.from_pretrained(tasks, model).to(device).predict(texts, names, pairs, batch_size,
                                                                               on_batch)
    elif len(tasks) == 1:
        name = next(iter(tasks))
        predictor = Predictor.load(tasks[name], load_backbone(model) if model else None, device)
        rows = []
        for t, p in zip(texts, pairs, strict=True):
            rows.append(predictor.predict([t], [p], name)[0])
            if on_batch is not None:
                on_batch(1)
    else:
        other = next(n for n, ok in shared.items() if not ok)
        raise ValueError(f"task {other!r} was trained with method {methods[other]!r}, which changes the encoder: "
                         f"several tasks run together only if all are AoT (fc, kron); give it alone")
    return {n: ({"id": item["id"]} if "id" in item else {}) | row for (n, item), row in zip(lines, rows, strict=True)}

