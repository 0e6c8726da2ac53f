"""A task's written version checked before it is published: what the served path computes (tokenizer, lookup, the
repository's backbone engine, head) against the task in PyTorch, for every kind, many tasks in one pass
(`aot export task`, `--batch`: aot.exporter.task_export.TaskExporter.validate)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aot.serving.columns import TaskColumn
from aot.serving.engine import BackboneRunner, EncoderBatch, EncoderOutput
from aot.serving.heads import embeddings, pooled_logits, token_logits
from aot.serving.kinds import NONE
from aot.serving.repository import RepositoryInfo
from aot.serving.stages import find_rows
from aot.serving.store.reader import StoreError
from aot.serving.store.writer import TaskStore
from aot.serving.tasks import load_task_version
from aot.serving.tokenization import Tokenization
from aot.training.multitask import MultiTaskModel

VALIDATION_TEXTS = (
    "A gripping, beautifully acted film.",
    "Dull, overlong and badly written; I left early.",
    "It is what it is.",
    "an utterly forgettable sequel that nonetheless has its moments of wit and charm " * 4,
)
LOGITS_TOLERANCE = 1e-3  # fp16 tables


class ValidationError(StoreError):
    """A written version whose served outputs differ from its PyTorch task's; `name` says which, `reason` how."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{reason}; nothing was published")
        self.name, self.reason = name, reason


def _served_outputs(task, out: EncoderOutput, rows: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """What the served head computes from the engine's states, by the task's kind: a pooled kind's logits (an
    embedding's vector) per text, or a token task's logits of each token."""
    if task.spec.reads_tokens:
        return [token_logits(task, out.states[k, :lengths[k]]) for k in rows.tolist()]
    pooled = out.pooled[rows]
    return list(embeddings(task, pooled) if task.spec.head == NONE else pooled_logits(task, pooled))


def validate_tasks(repo: RepositoryInfo, versions: list[tuple[str, Path]], reference: MultiTaskModel,
                   texts=VALIDATION_TEXTS, engine=None, tokens: Tokenization | None = None) -> list[float]:
    """Served path (tokenizer, lookup, the repository's backbone engine, head) against PyTorch for each written
    version (name, folder), all in one pass of each: max |difference| per version of what the head computes (logits,
    an embedding's vector, a token task's logits per token). `reference` holds each version's PyTorch task under its
    name (MultiTaskModel, rows in fp16 as stored); the texts of every version share one engine run and one PyTorch
    pass, grouped by length, so a batch's validation costs the tokens it checks, not a padded forward per task.
    `engine` and `tokens`: built once by a caller that validates many tasks."""
    tokens = tokens or Tokenization(repo.tokenizer_dir, repo.uses_token_type_ids)
    texts = list(texts)
    tasks, parts = [], []
    for name, folder in versions:
        task = load_task_version(folder, TaskStore.version_name(folder), repo.store_root)
        if task.spec.reads_tokens:
            parts.append(tokens.encode_words(texts, task.max_length)[0])
        else:
            parts.append(tokens.encode_batch(texts, None, task.max_length))
        tasks.append(task)
    batch = EncoderBatch.joined(parts)
    column = TaskColumn(tasks, np.repeat(np.arange(len(tasks)), len(texts)))
    batch.want_states = column.of("reads_tokens", bool)
    find_rows(batch, column, repo.vocab_size)
    out = (engine or validation_engine(repo)).run(batch)
    expected = reference.outputs(texts * len(versions), [name for name, _ in versions for _ in texts])
    diffs = []
    for t, task in enumerate(tasks):
        rows = np.arange(t * len(texts), (t + 1) * len(texts))
        got = _served_outputs(task, out, rows, batch.lengths)
        want = expected[rows[0]:rows[-1] + 1]
        diffs.append(max(float(np.abs(g - w.float().numpy()).max()) for g, w in zip(got, want, strict=True)))
    return diffs


def validation_engine(repo: RepositoryInfo):
    """The repository's backbone engine as the served steps run it on CPU (the AoT graph, or the torch engine)."""
    if repo.options.engine == "torch":
        from aot.serving_torch.engine import TorchBackbone

        return TorchBackbone(repo.encoder_dir, repo.uses_token_type_ids, aot=True)
    return BackboneRunner(repo.backbone_onnx)
