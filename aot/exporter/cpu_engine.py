"""A repository's CPU engine in this process: what the served CPU step computes for a task (tokenizer, rows of P,
the graph the CPU configs run, fp32 or int8, and the head), without a server. The accuracy gate scores a task's dev
examples with it, and `aot predict --repo` answers with it (the served int8 path's answers, in process). It runs the
served step's own stages (aot.serving.stages, aot.serving.heads), so it answers every kind as the server does: a
tagger's entities from its tokens' states, an embedding's vector, not only a pooled head's logits."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from aot.exporter.task_record import head_arrays, task_record
from aot.serving import protocol
from aot.serving.columns import TaskColumn
from aot.serving.engine import BackboneRunner
from aot.serving.heads import Answer, head_outputs
from aot.serving.repository import RepositoryInfo
from aot.serving.stages import TextPart, encode_parts, find_rows
from aot.serving.store.digests import file_digest
from aot.serving.tasks import ServedTask
from aot.serving.tokenization import Tokenization
from aot.training.artifact import TaskArtifact
from aot.training.model import TaskModel

CHUNK = 64  # requests per engine call (the int8 graph still runs them one at a time)


class CpuEngine:
    """The CPU configs' `aot` step of `repo`, in process: each request's tokens as the server tokenizes them (a
    token task's words too), its task's rows, the repository's CPU graph (aot.serving.repository: the int8 twin in an
    int8 repository, run one request at a time as served) and the task's head by its kind."""

    def __init__(self, repo: RepositoryInfo, threads: int = 0):
        self.repo = repo
        self.tokens = Tokenization(repo.tokenizer_dir, repo.uses_token_type_ids)
        self.graph = Path(repo.cpu_graph("backbone"))
        self.runner = BackboneRunner(self.graph, threads=threads, per_request=repo.record.cpu_per_request)

    @cached_property
    def graph_digest(self) -> str:
        """The sha256 of the graph this engine runs (hashed once): what a task's served score was measured on."""
        return file_digest(self.graph)

    def answers(self, task: ServedTask, items: list[tuple[str, str | None]]) -> list[Answer]:
        """The served step's answer to each of `items` (text, pair or None), in their order: its ANSWER (`body`) and
        LOGITS (`values`: a pooled kind's head outputs, an embedding's vector, a token task's logits of each word's
        first token)."""
        out: list[Answer] = []
        for start in range(0, len(items), CHUNK):
            chunk = items[start:start + CHUNK]
            part = TextPart(TaskColumn([task], np.zeros(len(chunk), np.int64)), [text for text, _ in chunk],
                            [pair for _, pair in chunk])
            batch = encode_parts(self.tokens, [part])
            find_rows(batch.encoder, batch.tasks, self.repo.vocab_size)
            heads = head_outputs(batch.tasks.groups(), self.runner.run(batch.encoder), batch.encoder.lengths,
                                 batch.words, batch.first)
            out += heads.answers(range(len(chunk)))
        return out


def task_from_model(model: TaskModel, artifact: TaskArtifact) -> ServedTask:
    """A trained AoT task as the server holds it, before any export: the task.json and head export would write
    (aot.exporter.task_record: its kind, threshold, normalization), and its rows computed by its own body for the tokens
    a request holds, rounded to fp16 as a fused table stores them."""
    body = model.body
    L, d, V = body.biased.num_layers, body.biased.hidden_size, int(body.embeddings.shape[0])

    def rows(token_ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return body.rows(torch.from_numpy(np.asarray(token_ids, np.int64))).float().numpy().astype(
                protocol.ROWS_DTYPE)

    name = artifact.spec.name
    meta = task_record(artifact, name, "factored", (L, d, V), artifact.backbone["fingerprint"])
    return ServedTask(name, f"{name}@000000000000", meta["labels"], artifact.max_length, "factored", L, d, V,
                      head_arrays(model), meta, compute_rows=rows)


def predict_lines_through(repo_dir: str | Path, tasks: dict[str, Path],
                          lines: list[tuple[int, dict]]) -> dict[int, dict]:
    """`aot predict --repo`: answers by line number (aot.training.predict.predict_lines' lines and answers) through
    `repo_dir`'s CPU engine, each task an artifact (not exported: its rows come from its own body)."""
    from aot.serving.repository import read_repository
    from aot.training.artifact import check_fingerprint
    from aot.training.backbone import load_backbone
    from aot.training.predict import Predictor

    repo = read_repository(repo_dir)
    engine, backbone, answers = CpuEngine(repo), load_backbone(repo.model), {}
    for name, folder in tasks.items():
        mine = [(number, item) for number, item in lines if item["task"] == name]
        if not mine:
            continue
        predictor = Predictor.load(folder, backbone)
        check_fingerprint(predictor.artifact, repo.fingerprint, f"{repo.model} (repository {repo.path})")
        served = engine.answers(task_from_model(predictor.model, predictor.artifact),
                                [(item["text"], item["text_pair"]) for _, item in mine])
        for (number, item), answer in zip(mine, served, strict=True):  # the answer aot predict gives (aot.serving.answers)
            answers[number] = ({"id": item["id"]} if "id" in item else {}) | {"task": name, **answer.body}
    return answers
