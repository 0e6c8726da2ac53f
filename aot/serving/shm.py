"""The python backend's shared-memory regions, private to the server's user.

Each stub exchanges its requests (texts, token ids, tensors) with tritonserver through a region in /dev/shm that the
backend creates with boost.interprocess at mode 0644: boost calls fchmod with its default permissions after shm_open,
so no umask applies, and any local user could read requests there. The stub makes its own region 0600 as its step
starts (before it can receive a request), and the supervisor does so too for every stub it finds (a backstop for
steps that are not ours). A user who opened a region in the instant between its creation and the stub's start keeps
that descriptor: on a host with untrusted local users, serve from the container, whose /dev/shm is its own
(docs/security.md)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
STUB = "triton_python_backend_stub"


def region_path(region: str) -> Path:
    """The file of a region as the stub's argv names it (`/NAME` or `NAME`)."""
    return SHM / region.lstrip("/")


def allocated_bytes(region: str) -> int:
    """Memory a region holds (its allocated pages: a region grows by ftruncate and is filled as it is used, and it
    never shrinks while its stub lives); 0 when it is gone."""
    try:
        return region_path(region).stat().st_blocks * 512
    except OSError:
        return 0


def make_private(regions: Iterable[str]) -> None:
    """Mode 0600 for each region that still exists (a stub that exited took its region along)."""
    for region in regions:
        try:
            os.chmod(region_path(region), 0o600)
        except FileNotFoundError:
            pass


def own_region() -> str | None:
    """The region of the stub this code runs in (its argv[2]); None outside a stub."""
    try:
        argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if len(argv) > 2 and argv[0].endswith(STUB.encode()):
        return os.fsdecode(argv[2])
    return None


def make_own_region_private() -> None:
    """The stub's side, as its step starts: its region 0600 before any request reaches it."""
    region = own_region()
    if region is not None:
        make_private([region])


def remove_regions(regions: Iterable[str]) -> None:
    """After the server exited: the regions its stubs left behind (a killed stub cannot remove its own)."""
    for region in regions:
        region_path(region).unlink(missing_ok=True)
