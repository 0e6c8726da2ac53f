"""Writing a folder so that readers see the old one or the new one, never half of either.

The content is written into a hidden sibling, then swapped in: rename(2) when the target does not exist, else
renameat2(RENAME_EXCHANGE) (Linux), which swaps both paths in one step. Where that call is missing, the old folder is
moved aside first (a crash in between leaves the old folder under `.NAME.old-*`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False when the platform cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_directory(src: Path, dst: Path) -> None:
    """Make `src` appear at `dst` in one step, removing what was at `dst`."""
    if not dst.exists():
        os.rename(src, dst)
    elif exchange(src, dst):
        shutil.rmtree(src)
    else:
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(dst.parent)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target: Path) -> None:
    """Remove `.NAME.tmp-PID-*` folders left by writers that died."""
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            pid = int(leftover.name.rsplit(".tmp-", 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces `target` atomically, on error it is removed."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        replace_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file through a temporary sibling and a rename: readers see the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
