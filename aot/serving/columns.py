"""A request's inputs, read as columns: the texts (or token sequences) it carries, one per row of its inputs' batch
dimension, checked a column at a time.

A client may send up to the model's max batch size of texts in one request (TEXT [N, 1], TASK [N, 1], optional
TEXT_PAIR [N, 1]; or token ids [N, S] right-padded by an attention mask), each with its own task: a client with
10,000 texts pays the per-request cost 10,000 / N times, not 10,000 times. Each input tensor is read from the python
backend once per request (RequestInputs) and checked as a whole array: what the server does per text is what the
tokenizer and the answer need, not Python per check. A check that refuses an item raises RequestError naming the
item (`item`: its row), and aot.serving.steps fails the whole request, naming it when the request carries several.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from aot.serving import protocol
from aot.serving.errors import RequestError
from aot.serving.repository import RepositoryInfo
from aot.serving.store.reader import check_task_spec
from aot.serving.store.tenants import TENANT_KEY_PARAMETER
from aot.serving.tasks import ServedTask


@dataclass
class TaskColumn:
    """Which task version each item of a request (or a batch) is served by: `tasks[index[k]]`."""

    tasks: list[ServedTask] = field(default_factory=list)
    index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def task(self, k: int) -> ServedTask:
        """Item k's task version."""
        return self.tasks[self.index[k]]

    def of(self, attribute: str, dtype=None) -> np.ndarray:
        """A task attribute per item (each task's read once)."""
        return np.array([getattr(t, attribute) for t in self.tasks], dtype=dtype)[self.index]

    def pairing(self) -> np.ndarray:
        """Per item, whether its task was trained on text pairs: 1, 0, or -1 for a version exported before it was
        recorded (it accepts both)."""
        return np.array([-1 if t.has_pair is None else int(t.has_pair) for t in self.tasks], np.int64)[self.index]

    def groups(self) -> list[tuple[ServedTask, np.ndarray]]:
        """Each task version and its items' rows, in ascending order."""
        order = np.argsort(self.index, kind="stable")
        bounds = np.searchsorted(self.index[order], np.arange(len(self.tasks) + 1))
        return [(task, order[bounds[t]:bounds[t + 1]]) for t, task in enumerate(self.tasks)
                if bounds[t + 1] > bounds[t]]

    @staticmethod
    def joined(columns: list[TaskColumn]) -> TaskColumn:
        """The columns of a batch's requests, one after the other, each version once."""
        found: dict[str, int] = {}
        tasks: list[ServedTask] = []
        parts = []
        for column in columns:
            where = np.empty(len(column.tasks), np.int64)
            for k, task in enumerate(column.tasks):
                if task.version not in found:
                    found[task.version] = len(tasks)
                    tasks.append(task)
                where[k] = found[task.version]
            parts.append(where[column.index])
        return TaskColumn(tasks, np.concatenate(parts) if parts else np.zeros(0, np.int64))


class RequestInputs:
    """One request's input tensors, each read from the python backend once."""

    def __init__(self, pb_utils, request):
        self.pb, self.request = pb_utils, request
        self._arrays: dict[str, np.ndarray | None] = {}
        self._parameters: dict | None = None  # not read yet
        self.count = 1

    def array(self, name: str) -> np.ndarray | None:
        if name not in self._arrays:
            tensor = self.pb.get_input_tensor_by_name(self.request, name)
            self._arrays[name] = None if tensor is None else tensor.as_numpy()
        return self._arrays[name]

    @property
    def parameters(self) -> dict:
        """The request's parameters (a JSON object; Triton forwards an ensemble's to its steps), read once."""
        if self._parameters is None:
            try:
                found = json.loads(self.request.parameters() or "{}")
            except ValueError:
                found = {}
            self._parameters = found if isinstance(found, dict) else {}
        return self._parameters

    @property
    def tenant_key(self) -> str | None:
        """The request's tenant key (aot.serving.store.tenants)."""
        value = self.parameters.get(TENANT_KEY_PARAMETER)
        return value if isinstance(value, str) and value else None

    @property
    def compact_answers(self) -> bool:
        """Whether the request asks for ANSWER only where the other outputs do not carry it (protocol)."""
        return self.parameters.get(protocol.ANSWERS_PARAMETER) == protocol.COMPACT_ANSWERS

    def read_count(self, names: tuple[str, ...]) -> int:
        """How many items the request carries (`count`): the batch dimension of the first of `names` it has (Triton
        checks that every input of a batched model has the same); 1 for a request without any (a malformed one,
        which its checks refuse by name)."""
        for name in names:
            array = self.array(name)
            if array is not None:
                if array.ndim == 0 or array.shape[0] < 1:
                    raise RequestError(f"{name} has shape {list(array.shape)}: expected [N, ...] with N >= 1 items")
                self.count = int(array.shape[0])
                return self.count
        return self.count

    def rows(self, name: str, required: bool = True) -> np.ndarray | None:
        """Input `name`, one row per item (None when the request has no such input and it is not `required`)."""
        array = self.array(name)
        if array is None:
            if required:
                raise RequestError(f"missing input {name}", item=0)
            return None
        if array.ndim == 0 or array.shape[0] != self.count:
            raise RequestError(f"{name} has shape {list(array.shape)}: expected {self.count} rows, one per item")
        return array

    def values(self, name: str, required: bool = True) -> np.ndarray | None:
        """The single element of each item's row of a BYTES input (TEXT, TASK: [N, 1]), [N]."""
        array = self.rows(name, required)
        if array is None:
            return None
        if array[0].size != 1:
            raise RequestError(f"{name} holds {array[0].size} values per item: send one per item, shape [N, 1]",
                               item=0)
        return array.reshape(-1)

    def texts(self, name: str, max_bytes: int, required: bool = True) -> list[str] | None:
        """Each item's UTF-8 text of input `name`, at most `max_bytes` each (the serving option max_text_bytes):
        decoded in one pass; an item refused is found by text() and named."""
        column = self.values(name, required)
        if column is None:
            return None
        try:
            if max(map(len, column)) <= max_bytes:
                return [value.decode("utf-8") for value in column]
        except (UnicodeDecodeError, AttributeError, TypeError):
            pass
        return [text(value, name, max_bytes, k) for k, value in enumerate(column)]

    def task_names(self, max_bytes: int) -> tuple[list[str], np.ndarray]:
        """The distinct tasks (or task versions) the items name, each checked as a name, in the order they first
        appear, and each item's index among them."""
        found: dict[str, int] = {}
        index = np.fromiter((found.setdefault(name, len(found)) for name in self.texts(protocol.TASK, max_bytes)),
                            np.int64, self.count)
        for name, k in found.items():
            try:
                check_task_spec(name)
            except ValueError as exc:
                raise RequestError(f"unknown task: {exc}", item=int(np.argmax(index == k))) from None
        return list(found), index

    def tokens(self, repo: RepositoryInfo) -> dict[str, np.ndarray]:
        """The items' token tensors [N, S], checked against the backbone's limits: lengths that agree, ids and
        token types in range, masks of 1s then 0s (right padding) that read their first token."""
        names = protocol.token_inputs(repo.uses_token_type_ids)
        tensors = {n: self.rows(n) for n in names}
        for name, array in tensors.items():
            if array.ndim != 2:
                raise RequestError(f"{name} has shape {list(array.shape)}: expected [N, S], one sequence per item",
                                   item=0)
        ids, mask = tensors[protocol.INPUT_IDS], tensors[protocol.ATTENTION_MASK]
        length = ids.shape[1]
        if not 1 <= length <= repo.max_positions:
            raise RequestError(f"{protocol.INPUT_IDS} has {length} tokens: expected 1 to {repo.max_positions}",
                               item=0)
        for name, array in tensors.items():
            if array.shape[1] != length:
                raise RequestError(f"{name} has {array.shape[1]} values but {protocol.INPUT_IDS} has {length}",
                                   item=0)
        limits = {protocol.INPUT_IDS: repo.vocab_size, protocol.ATTENTION_MASK: 2,
                  protocol.TOKEN_TYPE_IDS: max(repo.type_vocab_size, 1)}
        in_range = all(array.min() >= 0 and array.max() < limits[name] for name, array in tensors.items())
        padded_right = mask[:, 0].all() and (length == 1 or not (mask[:, 1:] > mask[:, :-1]).any())
        if in_range and padded_right:  # the whole request at once; the item at fault only when one is
            return tensors
        checks = []
        for name, array in tensors.items():
            limit = limits[name]
            checks.append((((array < 0) | (array >= limit)).any(1), lambda k, a=array, n=name, m=limit:
                           f"{n} holds {int(a[k][(a[k] < 0) | (a[k] >= m)][0])}: expected values in [0, {m - 1}]"))
        checks.append((mask[:, 0] != 1, lambda k: f"{protocol.ATTENTION_MASK} must start with 1 (the first token is "
                                                  "always read)"))
        checks.append(((mask[:, 1:] > mask[:, :-1]).any(1), lambda k: f"{protocol.ATTENTION_MASK} must be 1s "
                                                                       "followed by 0s (right padding)"))
        refuse_first(checks)
        return tensors


def refuse_first(checks: list[tuple[np.ndarray, Callable[[int], str]]], reason: str = "invalid") -> None:
    """Refuse the first item any check fails, with the message of the first check it fails: `checks` are (which
    items fail [N] bool, the message for item k), in the order an item is checked."""
    if not any(bad.any() for bad, _ in checks):
        return
    failing = [np.flatnonzero(bad) for bad, _ in checks]
    first = min(int(f[0]) for f in failing if len(f))
    for (bad, message), _ in zip(checks, failing, strict=True):
        if bad[first]:
            raise RequestError(message(first), reason, item=first)


def text(raw, name: str, max_bytes: int, item: int | None = None) -> str:
    """One UTF-8 text of input `name`, at most `max_bytes` (the serving option max_text_bytes); `item` names it."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise RequestError(f"{name} is {len(raw)} bytes; this server accepts at most {max_bytes} (serving option "
                           "max_text_bytes)", item=item)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{name} is not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})",
                           item=item) from None
