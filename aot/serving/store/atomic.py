"""Writing files and folders so that readers see the old one or the new one, never half of either.

Every writer of the project goes through here: a temporary sibling is written and fsynced, then renamed into place
(and the parent folder fsynced); on any failure (a full disk included) the temporary is removed and the target is
left as it was. A folder is swapped in with renameat2(RENAME_EXCHANGE) (Linux) when the target exists; where that
call is missing, the old folder is moved aside first (a crash in between leaves it under `.NAME.old-*`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc_function(name: str, argtypes: list):
    """A libc function by name (None where this platform's libc lacks it)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


_RENAMEAT2 = _libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
_SYNCFS = _libc_function("syncfs", [ctypes.c_int])


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root` (before it is renamed into place)."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def fsync_trees(roots: list[Path]) -> None:
    """fsync every file under several folders of one file system: for a batch, one syncfs of that file system (an
    fsync per file dominated publishing thousands of small tasks); else, or where syncfs fails, file by file."""
    if len(roots) > 1 and _SYNCFS is not None:
        fd = os.open(roots[0], os.O_RDONLY)
        try:
            if _SYNCFS(fd) == 0:
                return
        finally:
            os.close(fd)
    for root in roots:
        fsync_tree(root)


def plain_permissions(root: Path, private: Collection[str] = ()) -> None:
    """Give every file under `root` the mode open() gives (0666 less the umask; execute bits kept): some writers
    (safetensors) make theirs 0600, which left one file of a folder unreadable to those who can read the rest. The
    files named in `private` (paths relative to `root`: secrets) get 0600, their owner's alone."""
    mode = root.stat().st_mode & 0o666  # root was made by mkdir: 0777 less the umask
    secrets = {root / name for name in private}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o600 if path in secrets else mode | (path.stat().st_mode & 0o111 & root.stat().st_mode))


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
    fsync_dir(dst.parent)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temporary_name(target: Path) -> Path:
    """`.NAME.tmp-PID-RANDOM` beside `target`: hidden, unique, and naming its writer (see remove_stale_temporaries)."""
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale_temporaries(target: Path) -> None:
    """Remove `.NAME.tmp-PID-*` files and folders left by writers that died."""
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            pid = int(leftover.name.rsplit(".tmp-", 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(target: str | Path, private: Collection[str] = ()) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces `target` atomically, on error it is removed. Its
    files get one mode (plain_permissions), those named in `private` 0600."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp = temporary_name(target)
    tmp.mkdir()
    try:
        yield tmp
        plain_permissions(tmp, private)
        fsync_tree(tmp)
        replace_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write a file through a fsynced temporary sibling and a rename: readers see the old or the new file, and a
    failed write (ENOSPC, ...) leaves neither debris nor a changed file."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: str | Path, data) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")
