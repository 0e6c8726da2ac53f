"""A fused table read by verified blocks: a request reads a few rows of a table of V rows without hashing the rest,
and every row it reads was hashed after it was read from the file.

table.npy holds V rows of L x d fp16 after its .npy header (MiniLM: 141 MB). At publish `write_table_blocks` writes
beside it `table.blocks`: a JSON line {"format": "aot-table-blocks", "format_version": 1, "rows", "row_bytes",
"rows_per_block", "data_offset", "header_sha256"}, then the sha256 (32 bytes) of each block of `rows_per_block`
rows (about BLOCK_BYTES), in order. The store's index publishes table.blocks' own digest like every file's, so once
its sealed copy is checked (aot.serving.store.sealed) each block's digest is the publisher's. `VerifiedTable.rows`
reads the blocks that hold the rows asked for into private memory, hashes each there, and serves the rows from that
copy: never through a shared map of the file, which a writer could change after any check (a dirty page of a
writable mapping changes no timestamp). A block that differs refuses the version (DigestError).

A version published before block lists has its list derived on its first load on the host (`block_list` with the
table's digest): one read of the whole table, checked against that digest in the same pass.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aot.serving.store.backend import open_regular
from aot.serving.store.digests import DigestError
from aot.serving.store.layout import TABLE, TABLE_BLOCKS

BLOCKS_FORMAT = "aot-table-blocks"
BLOCK_BYTES = 4 << 10  # a block is one MiniLM row (4.5 KiB): a request reads and hashes only its rows
_HEADER_BYTES = 1 << 16  # an .npy header is at most this long (format 1.0; 2.0 allows more, numpy writes 1.0)
_CHUNK_BLOCKS = 64  # blocks read at once when a whole table is hashed


@dataclass(frozen=True)
class TableBlocks:
    """A table's block list, parsed (`digests`: its block digests, 32 bytes each, over the sealed copy)."""

    rows: int
    row_bytes: int
    rows_per_block: int
    data_offset: int
    header_sha256: str
    digests: memoryview

    @classmethod
    def parse(cls, data: memoryview, where: str) -> TableBlocks:
        data = memoryview(data)
        end = bytes(data[:4096]).find(b"\n")
        try:
            head = json.loads(bytes(data[:end])) if end > 0 else None
            if not isinstance(head, dict) or head.get("format") != BLOCKS_FORMAT or head.get("format_version") != 1:
                raise ValueError("not an aot-table-blocks file of format version 1")
            blocks = cls(int(head["rows"]), int(head["row_bytes"]), int(head["rows_per_block"]),
                         int(head["data_offset"]), str(head["header_sha256"]), data[end + 1:])
        except (ValueError, KeyError, TypeError) as exc:
            raise DigestError(f"{where}: {exc}") from None
        if blocks.rows_per_block < 1 or len(blocks.digests) != 32 * blocks.count:
            raise DigestError(f"{where}: {len(blocks.digests) // 32} block digests for {blocks.count} blocks")
        return blocks

    @property
    def count(self) -> int:
        return -(-self.rows // self.rows_per_block)


def _layout(path: Path, fd: int) -> tuple[int, tuple[int, ...], np.dtype, bytes]:
    """The table's data offset, shape, dtype and header bytes, read from its .npy header."""
    head = os.pread(fd, _HEADER_BYTES, 0)
    stream = io.BytesIO(head)
    try:
        major, _ = np.lib.format.read_magic(stream)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(stream)
    except ValueError as exc:
        raise DigestError(f"{path.name} is not a table ({exc})") from None
    if fortran or len(shape) != 3:
        raise DigestError(f"{path.name} is not a [V, L, d] table in C order")
    return stream.tell(), shape, dtype, head[:stream.tell()]


def block_list(path: Path, expected: str | None = None) -> bytes:
    """The table.blocks of the table at `path`, from one read of it. With `expected` (the table's published
    digest), DigestError unless the whole file has it: the list then describes the published bytes."""
    fd = open_regular(path)
    try:
        offset, shape, dtype, header = _layout(path, fd)
        row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
        per_block = max(1, BLOCK_BYTES // max(row_bytes, 1))
        whole, digests = hashlib.sha256(header), []
        buffer = memoryview(bytearray(_CHUNK_BLOCKS * per_block * row_bytes))
        for first in range(0, shape[0], _CHUNK_BLOCKS * per_block):
            size = (min(first + _CHUNK_BLOCKS * per_block, shape[0]) - first) * row_bytes
            if os.preadv(fd, [buffer[:size]], offset + first * row_bytes) != size:
                raise DigestError(f"{path.name} is damaged (shorter than its header says)")
            whole.update(buffer[:size])
            for start in range(0, size, per_block * row_bytes):
                digests.append(hashlib.sha256(buffer[start:min(start + per_block * row_bytes, size)]).digest())
        if os.fstat(fd).st_size != offset + shape[0] * row_bytes:
            raise DigestError(f"{path.name} is damaged (longer than its header says)")
    finally:
        os.close(fd)
    if expected is not None and f"sha256:{whole.hexdigest()}" != expected:
        raise DigestError(f"{path.name} is damaged (its sha256 differs from the one published)")
    head = {"format": BLOCKS_FORMAT, "format_version": 1, "rows": shape[0], "row_bytes": row_bytes,
            "rows_per_block": per_block, "data_offset": offset, "header_sha256": hashlib.sha256(header).hexdigest()}
    return json.dumps(head).encode() + b"\n" + b"".join(digests)


def write_table_blocks(folder: Path) -> None:
    """At publish: table.blocks beside a version's table.npy (nothing for a factored version)."""
    folder = Path(folder)
    if (folder / TABLE).is_file():
        (folder / TABLE_BLOCKS).write_bytes(block_list(folder / TABLE))


class VerifiedTable:
    """A fused table served by verified blocks (module docstring): `rows(ids)` -> [U, L, d] fp16, a private copy."""

    def __init__(self, path: Path, blocks: TableBlocks, version: str):
        self.path, self.blocks, self.version = Path(path), blocks, version
        self._file = open(open_regular(path), "rb", buffering=0)  # closed with the table (a request may hold it)
        offset, shape, self.dtype, header = _layout(self.path, self._file.fileno())
        if (hashlib.sha256(header).hexdigest() != blocks.header_sha256 or offset != blocks.data_offset
                or shape[0] != blocks.rows or int(np.prod(shape[1:])) * self.dtype.itemsize != blocks.row_bytes):
            raise DigestError(f"{version}: {TABLE} is damaged (its header differs from the one published)")
        size, expected = os.fstat(self._file.fileno()).st_size, offset + blocks.rows * blocks.row_bytes
        if size != expected:  # its rows past the cut would fail their reads: the whole version is refused at once
            raise DigestError(f"{version}: {TABLE} is damaged ({size} bytes, expected {expected}: truncated or replaced)")
        self.shape = tuple(shape)
        self._digests = bytes(blocks.digests)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows of token ids, read by their blocks, each block hashed after it was read."""
        ids = np.asarray(ids, dtype=np.int64)
        b = self.blocks
        if len(ids) and (ids.min() < 0 or ids.max() >= b.rows):
            raise IndexError(f"token ids outside the table's {b.rows} rows")
        numbers, inverse = np.unique(ids // b.rows_per_block, return_inverse=True)
        block = b.rows_per_block * b.row_bytes
        buffer = bytearray(len(numbers) * block)
        view, fd, digests, sha256 = memoryview(buffer), self._file.fileno(), self._digests, hashlib.sha256
        for i, number in enumerate(numbers.tolist()):
            size = block if (number + 1) * b.rows_per_block <= b.rows else (
                b.rows - number * b.rows_per_block) * b.row_bytes
            part = view[i * block:i * block + size]
            if (os.preadv(fd, [part], b.data_offset + number * block) != size
                    or sha256(part).digest() != digests[32 * number:32 * number + 32]):
                first = number * b.rows_per_block
                raise DigestError(f"{self.version}: {TABLE} is damaged (rows {first}-"
                                  f"{first + size // b.row_bytes - 1} differ from the ones published)")
        flat = np.frombuffer(buffer, self.dtype).reshape(len(numbers) * b.rows_per_block, *self.shape[1:])
        return flat[inverse * b.rows_per_block + ids % b.rows_per_block]

    def check(self, digest: str | None) -> None:
        """The whole table against its published digest and its block list (`aot export verify`, a re-check)."""
        if block_list(self.path, digest).split(b"\n", 1)[1] != bytes(self.blocks.digests):
            raise DigestError(f"{self.version}: {TABLE} does not match its block list")
