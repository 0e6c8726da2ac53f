"""Many AoT tasks on one frozen encoder in PyTorch, mixed in one batch whatever their kinds: offline batch scoring
(`aot predict` with several tasks) and the PyTorch counterpart of what the server does.

Each task keeps its fused rows P [V, L, d] (computed once, in eval mode, kept in fp16 as the task store keeps them,
so that its answers are the served ones) and its head; a task added unfused (`add_model(fuse=False)`, the
exporter's validation of many tasks at once) computes the rows of each batch's tokens from its factors instead, the
same fp16 values without a table of the whole vocabulary. A batch with one task name
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

from aot.serving.answers import tokens_answer
from aot.serving.kinds import DEFAULT_THRESHOLD, pooled_answer
from aot.serving.protocol import pooling_row
from aot.serving_torch.encoder import BiasedEncoder, pool_states
from aot.training.artifact import ArtifactError, load_recorded_backbone, read_task
from aot.training.backbone import Backbone, load_backbone
from aot.training.data.task import TaskSpec
from aot.training.factory import load_task
from aot.training.kinds.tokens import align
from aot.training.method_registry import method_spec
from aot.training.methods.aot_ptuning.peft_model import AotModel


@dataclass
class _Task:
    spec: TaskSpec
    max_length: int
    row: int  # the pooled row its head reads (aot.serving.protocol.pooling_row)
    rows: Callable[[torch.Tensor], torch.Tensor]  # token ids -> P's rows [U, L, d] fp16 (what the task store holds
    # and the server adds), CPU


@dataclass
class _Text:
    """One text as its task reads it: token ids (a token task's: its words' alignment too, aot.serving.words)."""

    ids: dict
    words: object = None
    first: object = None


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
        model.body.biased.remove_hooks()  # the rows are added below; this model's own hooks are not needed
        self.add_model(name, model)

    def add_model(self, name: str, model: AotModel, fuse: bool = True) -> None:
        """Add a loaded AoT task trained on this encoder, its hooks removed. `fuse`: compute its rows for the whole
        vocabulary now ([V, L, d] fp16, ~140 MB for MiniLM); else each batch's rows from its factors on use."""
        if name in self.tasks:
            raise ArtifactError(f"task name {name!r} is already loaded: remove_task it first")
        if fuse:
            rows = model.fused_rows().to(torch.float16).__getitem__
        else:
            body = model.body.eval()

            def rows(token_ids: torch.Tensor) -> torch.Tensor:
                return body.rows(token_ids.to(body.embeddings.device)).float().cpu().to(torch.float16)
        self.heads[name] = model.head.eval()
        self.tasks[name] = _Task(model.spec, model.aot_config.max_length, pooling_row(model.pooling), rows)

    def remove_task(self, name: str) -> None:
        if name not in self.tasks:
            raise ArtifactError(f"unknown task {name!r}; loaded: {', '.join(self.tasks) or '(none)'}")
        del self.tasks[name], self.heads[name]

    def _outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None,
                 task_names: Sequence[str]) -> list[torch.Tensor]:
        """Each row's head output: [n] (a pooled kind's logits or score, an embedding's vector [d]) or its tokens'
        logits [S, n] (a token task's), from one pass of the encoder over the whole batch."""
        groups = {name: [i for i, n in enumerate(task_names) if n == name] for name in dict.fromkeys(task_names)}
        device = input_ids.device
        index = torch.zeros_like(input_ids)
        rows, offset = [], 0
        out: list = [None] * len(task_names)
        with torch.no_grad():
            for name, members in groups.items():  # each task's rows for its own rows' distinct tokens
                unique, inverse = torch.unique(input_ids[members], return_inverse=True)
                rows.append(self.tasks[name].rows(unique.cpu()))
                index[members] = inverse + offset
                offset += len(unique)
            states = self.biased.states(input_ids, attention_mask, token_type_ids, torch.cat(rows).to(device), index)
            pooled = pool_states(states, attention_mask)
            for name, members in groups.items():
                task = self.tasks[name]
                read = states[members] if task.spec.kind_spec.reads_tokens else pooled[members, task.row]
                for i, row in zip(members, self.heads[name](read), strict=True):
                    out[i] = row
        return out

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, task_names: Sequence[str] = ()):
        """`task_names`: one per row, of tasks that answer from a pooled state (a token task's answers come from
        predict). Returns a SequenceClassifierOutput whose logits are [B, n] with n the widest head's output count
        (an embedding task's: its vector); a task with fewer outputs fills the rest of its rows with -inf."""
        from transformers.modeling_outputs import SequenceClassifierOutput  # on first use: seconds to import

        self._check_names(task_names, input_ids.shape[0])
        tokens = [n for n in task_names if self.tasks[n].spec.kind_spec.reads_tokens]
        if tokens:
            raise ValueError(f"task {tokens[0]!r} tags tokens: its answers come from predict()")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        outputs = self._outputs(input_ids, attention_mask, token_type_ids, task_names)
        logits = torch.full((input_ids.shape[0], max(len(o) for o in outputs)), -torch.inf, device=input_ids.device)
        for i, row in enumerate(outputs):
            logits[i, : len(row)] = row
        return SequenceClassifierOutput(logits=logits)

    def predict(self, texts: Sequence[str], task_names: Sequence[str], pairs: Sequence[str | None] | None = None,
                batch_size: int = 32, on_batch: Callable[[int], None] | None = None) -> list[dict]:
        """One answer per text, in order: the task's name and its kind's answer (aot.serving.answers). Each text is
        tokenized as its task was trained (its max length; a token task's words as in aot.serving.words), then rows of
        similar length share a batch whatever their tasks and kinds, on the device the model is on. `on_batch(n)`:
        after each batch of n texts (progress)."""
        encoded, outputs = self._run(texts, task_names, pairs, batch_size, on_batch)
        return [{"task": n, **self._answer(self.tasks[n], e, o)}
                for n, e, o in zip(task_names, encoded, outputs, strict=True)]

    def outputs(self, texts: Sequence[str], task_names: Sequence[str], pairs: Sequence[str | None] | None = None,
                batch_size: int = 32) -> list[torch.Tensor]:
        """What each text's task head computes, in order (batched as in predict): a pooled kind's logits or score
        [n], an embedding's vector [d], a token task's logits of each of its tokens [S, n]."""
        encoded, outputs = self._run(texts, task_names, pairs, batch_size)
        return [o[: len(e.ids["input_ids"])] if self.tasks[n].spec.kind_spec.reads_tokens else o
                for n, e, o in zip(task_names, encoded, outputs, strict=True)]

    def _run(self, texts, task_names, pairs, batch_size, on_batch=None) -> tuple[list[_Text], list[torch.Tensor]]:
        self._check_names(task_names, len(texts))
        pairs = list(pairs) if pairs is not None else [None] * len(texts)
        encoded = [self._encode(t, p, self.tasks[n]) for t, p, n in zip(texts, pairs, task_names, strict=True)]
        pad = self.backbone.tokenizer.pad_token_id or 0
        device = next(self.biased.parameters()).device
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i].ids["input_ids"]))
        outputs: list = [None] * len(texts)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            batch = {k: v.to(device) for k, v in _pad([encoded[i].ids for i in rows], pad).items()}
            for i, output in zip(rows, self._outputs(**batch, task_names=[task_names[i] for i in rows]), strict=True):
                outputs[i] = output
            if on_batch is not None:
                on_batch(len(rows))
        return encoded, outputs

    def _encode(self, text: str, pair: str | None, task: _Task) -> _Text:
        tokenizer = self.backbone.tokenizer
        if task.spec.kind_spec.reads_tokens:
            ids, types, words, first = align(tokenizer, text, task.max_length)
            return _Text({"input_ids": ids, **({"token_type_ids": types} if types else {})}, words, first)
        return _Text(tokenizer(text, pair, truncation=True, max_length=task.max_length))

    @staticmethod
    def _answer(task: _Task, text: _Text, output: torch.Tensor) -> dict:
        spec = task.spec
        values = output.float().cpu().numpy()
        if spec.kind_spec.reads_tokens:
            return tokens_answer(spec.labels, text.words, text.first, values[: len(text.ids["input_ids"])])
        threshold = DEFAULT_THRESHOLD if spec.threshold is None else spec.threshold
        return pooled_answer(spec.kind, spec.labels, values, threshold)

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
