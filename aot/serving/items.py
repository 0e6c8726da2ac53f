"""A request's items: the texts (or token sequences) it carries, one per row of its inputs' batch dimension.

A client may send up to the model's max batch size of texts in one request (TEXT [N, 1], TASK [N, 1], optional
TEXT_PAIR [N, 1]; or token ids [N, S] right-padded by an attention mask), each with its own task: a client with
10,000 texts pays the per-request cost 10,000 / N times, not 10,000 times. Each input tensor is read from the
python backend once per request (RequestInputs); an item reads its row of it. The checks every step applies to what
an item carries (ranges, lengths, UTF-8, the backbone's limits) live here, beside the item, and raise RequestError
naming the problem; aot.serving.steps fails the whole request, naming the item, when one of its items is refused.
"""

from __future__ import annotations

import numpy as np

from aot.serving import protocol
from aot.serving.errors import RequestError
from aot.serving.repository import RepositoryInfo
from aot.serving.store.reader import check_task_spec
from aot.serving.store.tenants import key_of_parameters


class RequestInputs:
    """One request's input tensors, each read from the python backend once and shared by its items."""

    def __init__(self, pb_utils, request):
        self.pb, self.request = pb_utils, request
        self._arrays: dict[str, np.ndarray | None] = {}
        self._tenant_key: str | None | bool = False  # False: not read yet

    def array(self, name: str) -> np.ndarray | None:
        if name not in self._arrays:
            tensor = self.pb.get_input_tensor_by_name(self.request, name)
            self._arrays[name] = None if tensor is None else tensor.as_numpy()
        return self._arrays[name]

    @property
    def tenant_key(self) -> str | None:
        """The request's tenant key (aot.serving.store.tenants; Triton forwards an ensemble's parameters)."""
        if self._tenant_key is False:
            self._tenant_key = key_of_parameters(self.request.parameters())
        return self._tenant_key

    def count(self, names: tuple[str, ...]) -> int:
        """How many items the request carries: the batch dimension of the first of `names` it has (Triton checks
        that every input of a batched model has the same); 1 for a request without any (a malformed one, which
        its first item's checks refuse by name)."""
        for name in names:
            array = self.array(name)
            if array is not None:
                if array.ndim == 0 or array.shape[0] < 1:
                    raise RequestError(f"{name} has shape {list(array.shape)}: expected [N, ...] with N >= 1 items")
                return int(array.shape[0])
        return 1


class Item:
    """Row `row` of a request's inputs: one text, or one token sequence, and the task it names."""

    __slots__ = ("inputs", "row", "count")

    def __init__(self, inputs: RequestInputs, row: int, count: int):
        self.inputs, self.row, self.count = inputs, row, count

    def array(self, name: str, required: bool = True) -> np.ndarray | None:
        """This item's row of input `name` (None when the request has no such input and it is not `required`)."""
        array = self.inputs.array(name)
        if array is None:
            if required:
                raise RequestError(f"missing input {name}")
            return None
        if array.ndim == 0 or array.shape[0] != self.count:
            raise RequestError(f"{name} has shape {list(array.shape)}: expected {self.count} rows, one per item")
        return array[self.row]

    def value(self, name: str, required: bool = True):
        """The single element of this item's row of a BYTES input (TEXT, TASK: [N, 1])."""
        row = self.array(name, required)
        if row is None:
            return None
        if row.size != 1:
            raise RequestError(f"{name} holds {row.size} values per item: send one per item, shape [N, 1]")
        return row.reshape(-1)[0]

    def sequence(self, name: str) -> np.ndarray:
        """This item's token sequence of input `name` ([N, S]: the item's row), as 1-D."""
        row = self.array(name)
        if row.ndim != 1:
            raise RequestError(f"{name} has shape {[self.count, *row.shape]}: expected [N, S], one sequence per item")
        return row


def text(item: Item, name: str, max_bytes: int, required: bool = True) -> str | None:
    """An item's UTF-8 text of input `name`, at most `max_bytes` (the serving option max_text_bytes)."""
    raw = item.value(name, required)
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise RequestError(f"{name} is {len(raw)} bytes; this server accepts at most {max_bytes} (serving option "
                           "max_text_bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{name} is not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") \
            from None


def task_name(item: Item, max_bytes: int) -> str:
    """The task (or task version) an item names, checked as a name."""
    name = text(item, protocol.TASK, max_bytes)
    try:
        return check_task_spec(name)
    except ValueError as exc:
        raise RequestError(f"unknown task: {exc}") from None


def tokens(item: Item, repo: RepositoryInfo) -> dict[str, np.ndarray]:
    """An item's token tensors, checked against the backbone's limits: lengths that agree, ids and token types in
    range, a mask of 1s then 0s (right padding) that reads the first token."""
    names = protocol.token_inputs(repo.uses_token_type_ids)
    tensors = {n: item.sequence(n) for n in names}
    ids, mask = tensors[protocol.INPUT_IDS], tensors[protocol.ATTENTION_MASK]
    length = len(ids)
    if not 1 <= length <= repo.max_positions:
        raise RequestError(f"{protocol.INPUT_IDS} has {length} tokens: expected 1 to {repo.max_positions}")
    for name, array in tensors.items():
        if len(array) != length:
            raise RequestError(f"{name} has {len(array)} values but {protocol.INPUT_IDS} has {length}")
    limits = {protocol.INPUT_IDS: repo.vocab_size, protocol.ATTENTION_MASK: 2,
              protocol.TOKEN_TYPE_IDS: max(repo.type_vocab_size, 1)}
    for name, array in tensors.items():
        if array.min() < 0 or array.max() >= limits[name]:
            bad = array[(array < 0) | (array >= limits[name])][0]
            raise RequestError(f"{name} holds {int(bad)}: expected values in [0, {limits[name] - 1}]")
    if not mask[0]:
        raise RequestError(f"{protocol.ATTENTION_MASK} must start with 1 (the first token is always read)")
    if mask[: int(mask.sum())].min() == 0:
        raise RequestError(f"{protocol.ATTENTION_MASK} must be 1s followed by 0s (right padding)")
    return tensors
