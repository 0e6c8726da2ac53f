"""Many AoT tasks on one frozen encoder in PyTorch, mixed in one batch: offline batch scoring (`aot predict` with
several tasks) and the PyTorch counterpart of what the server does.

Each task keeps its fused rows P [V, L, d] (computed once, in eval mode) and its head. A batch with one task name
per row costs, beyond the plain encoder, one gather of each task's rows for its rows' distinct tokens and, per
layer, the gather and add of BiasedEncoder (PEFT's mixed-adapter batches need a forward per adapter instead).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from serving.protocol import pooling_row
from serving_torch.encoder import BiasedEncoder
from training.answer import answer
from training.artifact import ArtifactError, load_recorded_backbone, read_task
from training.backbone import Backbone, load_backbone
from training.data.task import TaskSpec
from training.factory import load_task
from training.methods.aot_ptuning.peft_model import AotModel
from training.method_registry import method_spec


@dataclass
class _Task:
    spec: TaskSpec
    max_length: int
    row: int  # the pooled row its head reads (serving.protocol.pooling_row)
    table: torch.Tensor  # fused P, [V, L, d] fp32, CPU


class MultiTaskModel(nn.Module):
    """One frozen encoder and any number of AoT tasks trained on it (the same backbone fingerprint)."""

    def __init__(self, backbone: Backbone):
        super().__init__()
        self.backbone = backbone
        backbone.encoder.requires_grad_(False)
        self.biased = BiasedEncoder(backbone.encoder, backbone.uses_token_type_ids)
        self.heads = nn.ModuleDict()
        self.tasks: dict[str, _Task] = {}
        self.eval()

    @classmethod
    def from_pretrained(cls, tasks: dict[str, str | os.PathLike], base_model: str | None = None) -> "MultiTaskModel":
        """`tasks`: name -> task artifact folder (aot train or save_pretrained). The encoder is the one the first
        task records, or `base_model` (a folder, 'minilm' or a hub id); every task must have been trained on it."""
        if not tasks:
            raise ArtifactError("MultiTaskModel.from_pretrained: no tasks given")
        first = read_task(next(iter(tasks.values())))
        model = cls(load_backbone(base_model) if base_model else load_recorded_backbone(first))
        for name, path in tasks.items():
            model.add_task(name, path)
        return model

    @property
    def task_names(self) -> list[str]:
        return list(self.tasks)

    def add_task(self, name: str, path: str | os.PathLike) -> None:
        """Load a task artifact and fuse its rows; refused if `name` is taken or it was trained on another backbone
        or with a method that changes the encoder."""
        if name in self.tasks:
            raise ArtifactError(f"task name {name!r} is already loaded: remove_task it first")
        artifact = read_task(path)
        if not method_spec(artifact.method_config.method).shared_backbone:
            raise ArtifactError(f"task {path} was trained with method {artifact.method_config.method!r}; "
                                f"MultiTaskModel runs AoT tasks (fc, kron), which leave the encoder unchanged")
        _, model, _ = load_task(Path(path), self.backbone, copy_encoder=False)
        assert isinstance(model, AotModel)
        model.body.biased.remove_hooks()  # the rows are fused below; this model's own hooks are not needed
        self.heads[name] = model.head.eval()
        self.tasks[name] = _Task(model.spec, model.aot_config.max_length, pooling_row(model.pooling),
                                 model.fused_rows())

    def remove_task(self, name: str) -> None:
        if name not in self.tasks:
            raise ArtifactError(f"unknown task {name!r}; loaded: {', '.join(self.tasks) or '(none)'}")
        del self.tasks[name], self.heads[name]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, task_names: Sequence[str] = ()):
        """`task_names`: one per row. Returns a SequenceClassifierOutput whose logits are [B, n] with n the widest
        head's output count; a task with fewer outputs fills the rest of its rows with -inf."""
        from transformers.modeling_outputs import SequenceClassifierOutput  # on first use: seconds to import

        self._check_names(task_names, input_ids.shape[0])
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        groups = {name: [i for i, n in enumerate(task_names) if n == name] for name in dict.fromkeys(task_names)}
        device = input_ids.device
        index = torch.zeros_like(input_ids)
        rows, offset = [], 0
        for name, members in groups.items():  # each task's rows for its own rows' distinct tokens
            unique, inverse = torch.unique(input_ids[members], return_inverse=True)
            rows.append(self.tasks[name].table[unique.cpu()])
            index[members] = inverse + offset
            offset += len(unique)
        with torch.no_grad():
            pooled = self.biased(input_ids, attention_mask, token_type_ids, torch.cat(rows).to(device), index)
            width = max(self.tasks[n].spec.num_outputs for n in groups)
            logits = torch.full((input_ids.shape[0], width), -torch.inf, device=device)
            for name, members in groups.items():
                out = self.heads[name](pooled[members, self.tasks[name].row])
                logits[members, : out.shape[1]] = out
        return SequenceClassifierOutput(logits=logits)

    def predict(self, texts: Sequence[str], task_names: Sequence[str], pairs: Sequence[str | None] | None = None,
                batch_size: int = 32, on_batch: Callable[[int], None] | None = None) -> list[dict]:
        """One answer per text, in order (training.answer.answer: task, label, logits, probabilities).
        Each text is tokenized as its task was trained (its max length), then rows of similar length share a batch
        whatever their tasks, on the device the model is on. `on_batch(n)`: after each batch of n texts (progress)."""
        self._check_names(task_names, len(texts))
        pairs = list(pairs) if pairs is not None else [None] * len(texts)
        tokenizer = self.backbone.tokenizer
        encoded = [tokenizer(t, p, truncation=True, max_length=self.tasks[n].max_length)
                   for t, p, n in zip(texts, pairs, task_names)]
        pad = tokenizer.pad_token_id or 0
        device = next(self.biased.parameters()).device
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i]["input_ids"]))
        answers: list[dict] = [{}] * len(texts)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            batch = {k: v.to(device) for k, v in _pad([encoded[i] for i in rows], pad).items()}
            logits = self.forward(**batch, task_names=[task_names[i] for i in rows]).logits.cpu()
            for i, row in zip(rows, logits):
                answers[i] = answer(task_names[i], self.tasks[task_names[i]].spec, row)
            if on_batch is not None:
                on_batch(len(rows))
        return answers

    def _check_names(self, task_names: Sequence[str], rows: int) -> None:
        if len(task_names) != rows:
            raise ValueError(f"task_names has {len(task_names)} names for {rows} rows: give one per row")
        unknown = sorted(set(task_names) - set(self.tasks))
        if unknown:
            raise ValueError(f"unknown task {unknown[0]!r}; loaded: {', '.join(self.tasks) or '(none)'}")


def _pad(encodings: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(e["input_ids"]) for e in encodings)
    ids = torch.full((len(encodings), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encodings), length), dtype=torch.long)
    types = torch.zeros((len(encodings), length), dtype=torch.long)
    for k, e in enumerate(encodings):
        n = len(e["input_ids"])
        ids[k, :n] = torch.tensor(e["input_ids"])
        mask[k, :n] = 1
        if "token_type_ids" in e:
            types[k, :n] = torch.tensor(e["token_type_ids"])
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
