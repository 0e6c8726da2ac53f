"""What /proc says about a server's processes: one reader of /proc/PID/stat, and the python-backend stubs a
tritonserver started (their command line names the stub, the model file, the shared-memory region, the server's
pid and the instance)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from aot.serving.shm import STUB

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat the supervisor reads."""

    state: str  # R, S, D, T (stopped), t (traced), Z (zombie)
    cpu_seconds: float  # user + system CPU time
    started: int  # clock ticks after boot: which of two processes is newer

    @property
    def alive(self) -> bool:
        """Running and not a zombie."""
        return self.state != "Z"

    @property
    def stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP). Not `t`: a debugger or py-spy pauses a process that way while it samples."""
        return self.state == "T"


def proc_stat(pid: int) -> ProcStat | None:
    """The process's /proc/PID/stat (None when it is gone). The name in parentheses may hold spaces and ')': the
    fields are counted from the last ')'."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return ProcStat(fields[0], (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS, int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    stat = proc_stat(pid)
    return stat is not None and stat.alive


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@dataclass(frozen=True)
class Stub:
    pid: int
    instance: str  # e.g. backbone_0_0
    model: str  # the model folder's name
    shm_region: str
    stat: ProcStat  # read when the stub was found: its state and CPU at that moment

    @property
    def started(self) -> int:
        """Clock ticks after boot: which of two processes of one instance is newer."""
        return self.stat.started


def stub_processes(server_pid: int) -> list[Stub]:
    """Every live stub process a server started (argv: stub, model.py, shm region, sizes, parent pid, ...,
    instance). Two may carry one instance's name for a few seconds after a reload: the unloaded one on its way out,
    and the new one."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        argv = cmdline(pid)
        if len(argv) > 8 and argv[0].endswith(STUB) and argv[5] == str(server_pid):
            stat = proc_stat(pid)
            if stat is not None and stat.alive:
                found.append(Stub(pid, argv[8], Path(argv[1]).parents[1].name, argv[2], stat))
    return found


def stubs_of(server_pid: int) -> dict[str, Stub]:
    """The live stub of each instance: the newest process of that name (an unloaded one may linger a few seconds)."""
    found: dict[str, Stub] = {}
    for stub in sorted(stub_processes(server_pid), key=lambda s: (s.started, s.pid)):
        found[stub.instance] = stub
    return found
