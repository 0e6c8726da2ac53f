"""Sealed copies of a task version's files: what a request reads are bytes hashed after they were last written.

A version's files (but a fused table, read by verified blocks: aot.serving.store.table_blocks) are copied into one
memfd, sealed (F_SEAL_WRITE, F_SEAL_GROW, F_SEAL_SHRINK, then F_SEAL_SEAL so that the seals stay), mapped read-only
and only then hashed, each file's bytes in the copy against its published digest. From then on the kernel refuses
every write to the copy, a writable mapping of it and its truncation, to any process, one of the server's own user
included; the store's file is never read again for this copy, so a writer that changes it (through a shared
writable mapping, which changes no timestamp once its page is dirty) changes nothing a request reads. A copy is
shared by a host's processes through aot.serving.store.host_cache, which opens it as /proc/PID/fd/FD and takes it
only if it is the same sealed copy (`open_sealed`).

A copy's layout: its directory at offset 0, one JSON line {"version", "files": {name: [offset, size, digest]}}
(the digests it must have: the published ones), padded to pages; each file at a 64-byte aligned offset. Written,
then sealed, then checked: a copy that fails the check is closed, never listed. Safetensors files are read in place (`tensors`: arrays
over the copy, no second copy in the process).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aot.serving.store.backend import BackendError, open_regular
from aot.serving.store.digests import DigestError

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_PAGE = mmap.PAGESIZE
_ALIGN = 64
_SAFETENSORS = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SealError(ValueError):
    """A copy that is not the sealed copy its index record says (another file, unsealed, of another size)."""


def digest_of(data) -> str:
    """`sha256:<hex>` of a bytes-like object (the store's digest format: aot.serving.store.digests)."""
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass(eq=False)
class SealedVersion:
    """A sealed copy, mapped read-only in this process. `fd` stays open while this process holds the copy for others
    (host_cache), `shared` says whether the host's index lists it. Its arrays keep the map alive after `release`:
    a request that reads a copy evicted meanwhile reads it whole."""

    version: str
    memory: mmap.mmap
    files: dict[str, tuple[int, int, str]]  # name -> (offset, size, digest)
    size: int
    ino: int
    fd: int | None
    shared: bool = False  # listed in the host's index (aot.serving.store.host_cache), under `key`
    key: bytes = b""
    evicted: bool = False  # the host evicted it: its users let it go

    def view(self, name: str) -> memoryview:
        offset, size, _ = self.files[name]
        return memoryview(self.memory)[offset:offset + size]

    def text(self, name: str) -> str:
        return bytes(self.view(name)).decode("utf-8")

    def tensors(self, name: str) -> dict[str, np.ndarray]:
        return tensors(self.view(name), f"{self.version}/{name}")

    def release(self) -> None:
        """Close the descriptor (the map stays while arrays over it live)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def tensors(buffer: memoryview, where: str) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as read-only arrays over `buffer` (no copy); ValueError naming `where` when it
    is not one, or holds a dtype numpy has not (bf16: none is served)."""
    try:
        length = int.from_bytes(buffer[:8], "little")
        header = json.loads(bytes(buffer[8:8 + length]))
        base, out = 8 + length, {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = np.dtype(_SAFETENSORS[info["dtype"]])
            start, end = info["data_offsets"]
            count = int(np.prod(info["shape"], dtype=np.int64))
            if not 0 <= start <= end <= len(buffer) - base or count * dtype.itemsize != end - start:
                raise ValueError(f"tensor {name!r} lies outside the file")
            out[name] = np.frombuffer(buffer, dtype, count, base + start).reshape(info["shape"])
        return out
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} is not a safetensors file this server reads ({exc})") from None


def seal_files(version: str, sources: Mapping[str, Path | bytes], digests: Mapping[str, str] | None) -> SealedVersion:
    """Copy `sources` (file name -> a path in the version's folder, or bytes this process computed) into a sealed
    copy, then check each path's bytes in the copy against `digests` (None: a version published before digests, read
    unverified). DigestError names a file that is missing, not a regular file, or not as published."""
    handles: dict[str, int] = {}
    try:
        files, offset = {}, 0
        for name, source in sorted(sources.items()):
            if isinstance(source, bytes):
                size, expected = len(source), digest_of(source)
            else:
                handles[name] = _open(source, version, name)
                size = os.fstat(handles[name]).st_size
                expected = "" if digests is None else digests.get(name)
                if expected is None:
                    raise DigestError(f"{version}: {name} has no published digest")
            files[name] = [offset, size, expected]
            offset = -(-(offset + size) // _ALIGN) * _ALIGN
        head = -(-(len(json.dumps({"version": version, "files": files})) + 24 * len(files) + 1) // _PAGE) * _PAGE
        for entry in files.values():
            entry[0] += head
        line = json.dumps({"version": version, "files": files}).encode() + b"\n"
        total = head + offset
        fd = os.memfd_create(f"aot:{version}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, total)
            os.pwrite(fd, line, 0)
            for name, (start, size, _) in files.items():
                _copy_into(fd, handles.get(name, sources[name]), start, size, version, name)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            memory = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            for name, (start, size, expected) in files.items():  # hashed in the sealed copy: nothing changes it now
                if digests is not None and digest_of(memoryview(memory)[start:start + size]) != expected:
                    raise DigestError(f"{version}: {name} is damaged (its sha256 differs from the one published)")
        except BaseException:
            os.close(fd)
            raise
    finally:
        for handle in handles.values():
            os.close(handle)
    return SealedVersion(version, memory, {n: (o, s, d) for n, (o, s, d) in files.items()}, total,
                         os.fstat(fd).st_ino, fd)


def _open(path: Path, version: str, name: str) -> int:
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise DigestError(f"{version}: {name} is missing") from None
    except (BackendError, OSError) as exc:  # a link, device or FIFO in the version's folder, or unreadable
        raise DigestError(f"{version}: {name}: {exc}".replace(str(path), name)) from None


def _copy_into(fd: int, source: int | bytes, offset: int, size: int, version: str, name: str) -> None:
    if isinstance(source, bytes):
        os.pwrite(fd, source, offset)
        return
    os.lseek(fd, offset, os.SEEK_SET)
    copied = 0
    while copied < size:
        sent = os.sendfile(fd, source, copied, size - copied)
        if sent == 0:
            raise DigestError(f"{version}: {name} is damaged (it was truncated under the server)")
        copied += sent


def open_sealed(path: str, ino: int, size: int, version: str, digests: Mapping[str, str]) -> SealedVersion:
    """Another process's sealed copy, as /proc/PID/fd/FD: SealError unless it is the copy the index names (its
    inode and size), sealed, of this user, and its directory names `version` with `digests` (every file in both
    agrees; a file not published, a fused table's derived block list, is taken as its maker hashed it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):  # this process's limit, not the copy's fault
            raise
        raise SealError(f"{path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != ino or st.st_size != size or st.st_uid != os.geteuid():
            raise SealError(f"{path} is not the copy the index names")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise SealError(f"{path} is not sealed")
        memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            end = memory.find(b"\n", 0, min(size, _PAGE * 16))
            directory = json.loads(memory[:end]) if end > 0 else {}
            files = {n: (int(o), int(s), str(d)) for n, (o, s, d) in directory["files"].items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise SealError(f"{path}: no directory ({exc})") from None
        if directory.get("version") != version or any(files[n][2] != d for n, d in digests.items() if n in files):
            raise SealError(f"{path} holds another version")
        if any(o + s > size for o, s, _ in files.values()):
            raise SealError(f"{path}: a file lies outside the copy")
        return SealedVersion(version, memory, files, size, ino, fd)
    except BaseException:
        os.close(fd)
        raise
