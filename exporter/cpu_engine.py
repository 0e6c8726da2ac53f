"""A repository's CPU engine in this process: what the served CPU step computes for a task (tokenizer, rows of P,
the graph the CPU configs run, fp32 or int8, and the head), without a server. The accuracy gate scores a task's dev
examples with it, and `aot predict --repo` answers with it (the served int8 path's answers, in process)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from serving import protocol
from serving.engine import BackboneRunner, Prepared
from serving.repository import RepositoryInfo
from serving.tasks import ServedTask
from serving.tokenization import Tokenization
from training.artifact import TaskArtifact
from training.model import TaskModel

CHUNK = 64  # requests per engine call (the int8 graph still runs them one at a time)


class CpuEngine:
    """The CPU configs' `aot` step of `repo`, in process: each request's tokens as the server tokenizes them, its
    task's rows, the repository's CPU graph (serving.repository: the int8 twin in an int8 repository, run one request
    at a time as served) and the task's head."""

    def __init__(self, repo: RepositoryInfo, threads: int = 0):
        self.repo = repo
        self.tokens = Tokenization(repo.tokenizer_dir, repo.uses_token_type_ids)
        self.runner = BackboneRunner(repo.cpu_graph("backbone"), threads=threads,
                                     per_request=repo.record.cpu_precision == "int8")

    def logits(self, task: ServedTask, items: list[tuple[str, str | None]]) -> np.ndarray:
        """Logits [N, n] of `items` (text, pair or None), in their order."""
        out = []
        for start in range(0, len(items), CHUNK):
            encoded = self.tokens.encode_batch(items[start:start + CHUNK], task.max_length)
            requests = [Prepared.for_task(tokens, task) for tokens in encoded]
            for request in requests:
                request.rows = task.rows(request.unique)
            out.append(task.logits(self.runner.run(requests)))
        return np.concatenate(out) if out else np.zeros((0, 0), protocol.LOGITS_DTYPE)


def task_from_model(model: TaskModel, artifact: TaskArtifact) -> ServedTask:
    """A trained AoT task as the server holds it, before any export: its rows computed by its own body for the
    tokens a request holds, rounded to fp16 as a fused table stores them, and its head in the served format."""
    body = model.body
    L, d = body.biased.num_layers, body.biased.hidden_size

    def rows(token_ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return body.rows(torch.from_numpy(np.asarray(token_ids, np.int64))).float().numpy().astype(
                protocol.ROWS_DTYPE)

    head = {k: v.detach().float().numpy().copy() for k, v in model.head.state_dict().items()}
    spec = artifact.spec
    labels = None if spec.labels is None else list(spec.labels)
    return ServedTask(spec.name, f"{spec.name}@000000000000", labels, artifact.max_length, "factored", L, d,
                      int(body.embeddings.shape[0]), head,
                      {"pooling": artifact.pooling, "head_activation": artifact.head["activation"],
                       "has_pair": spec.has_pair}, compute_rows=rows)


def predict_lines_through(repo_dir: str | Path, tasks: dict[str, Path],
                          lines: list[tuple[int, dict]]) -> dict[int, dict]:
    """`aot predict --repo`: answers by line number (training.predict.predict_lines' lines and answers) through
    `repo_dir`'s CPU engine, each task an artifact (not exported: its rows come from its own body)."""
    from serving.answers import DEFAULT_THRESHOLD, pooled_answer
    from serving.repository import read_repository
    from training.artifact import check_fingerprint
    from training.backbone import load_backbone
    from training.predict import Predictor

    repo = read_repository(repo_dir)
    engine, backbone, answers = CpuEngine(repo), load_backbone(repo.model), {}
    for name, folder in tasks.items():
        mine = [(number, item) for number, item in lines if item["task"] == name]
        if not mine:
            continue
        predictor = Predictor.load(folder, backbone)
        check_fingerprint(predictor.artifact, repo.fingerprint, f"{repo.model} (repository {repo.path})")
        logits = engine.logits(task_from_model(predictor.model, predictor.artifact),
                               [(item["text"], item["text_pair"]) for _, item in mine])
        spec = predictor.artifact.spec
        threshold = DEFAULT_THRESHOLD if spec.threshold is None else spec.threshold
        for (number, item), row in zip(mine, logits):  # the answer aot predict gives (serving.answers)
            answers[number] = ({"id": item["id"]} if "id" in item else {}) | {
                "task": name, **pooled_answer(spec.kind, spec.labels, row[: spec.num_outputs], threshold)}
    return answers
