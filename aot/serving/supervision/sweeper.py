"""A server's python stubs end with it, whatever ended it: `reap`, and the sweeper that runs it when no owner is left.

Triton 2.51's stub checks every 300 ms that its server lives and exits when it is gone, but an `aot` stub's exit
deadlocks when its server vanished without unloading it (killed, crashed, or out of its exit timeout): a step's
metrics thread blocks in `Metric.set`, which holds the GIL while it waits for the dead server's answer (python_backend
src/metric.cc, SendSetValueRequest: no gil_scoped_release), and the stub's exit waits for that thread. Measured
(issue 57.8): every `aot` stub of a killed server, a replaced instance's too, ran on forever, 130 MB each; the first
instances' stubs of a stopped server died only because Triton unloaded them before its exit timeout ran out.

Whoever stops a server reaps its stubs (aot.serving.supervision.lifecycle). When that owner is killed itself (`kill
-9` of `aot serve`), the sweeper does: a small process in a session of its own (a signal to the owner's process
group does not reach it), started beside each server, that waits for the server's end (a pidfd: a zombie counts),
noting its stubs' shared-memory regions meanwhile, gives the stubs GRACE_SECONDS to exit by themselves, then kills
those that did not and removes every region it noted (a stub that exits by itself may leave its own) and the
server's watch files. Its owner ends it once it has reaped the server itself.
PR_SET_PDEATHSIG in the stubs cannot do this: it fires when the *thread* that forked a process ends, and Triton forks
stubs from short-lived threads (parallel instance loading, std::async in core's backend_model.cc).

    python3 -m aot.serving.supervision.sweeper SERVER_PID SERVER_START_TICKS
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import IO

from aot.serving.shm import remove_regions
from aot.serving.supervision.procfs import alive, proc_stat, stub_processes
from aot.serving.watch import remove_watches

GRACE_SECONDS = 2.0  # a stub whose server is gone exits by itself within 300 ms (when it does not deadlock)
LOOK_SECONDS = 5.0  # how often the sweeper notes the server's stubs' shared memory while it runs
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def reap(server_pid: int, regions: Iterable[str] = (), born_before: int | None = None) -> int:
    """After the server exited: SIGKILL its stubs (only those started before `born_before`, in clock ticks after
    boot, when given: a pid reused since is another server's) and remove their (and `regions`') shared memory and
    the server's watch files. Returns how many stubs were killed."""
    stubs = {s.pid: s for s in stub_processes(server_pid) if born_before is None or s.started <= born_before}
    for stub in stubs.values():
        try:
            os.kill(stub.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while any(alive(s.pid) for s in stubs.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    remove_regions({s.shm_region for s in stubs.values()} | set(regions))
    remove_watches(server_pid)
    return len(stubs)


def start_sweeper(server: subprocess.Popen, log: IO | None = None) -> subprocess.Popen | None:
    """The sweeper of a server just started (None when the server is gone already); `log` takes its one line."""
    stat = proc_stat(server.pid)
    if stat is None:
        return None
    output = log or subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", __name__, str(server.pid), str(stat.started)],
                            stdin=subprocess.DEVNULL, stdout=output, stderr=output, start_new_session=True)


def stop_sweeper(sweeper: subprocess.Popen | None) -> None:
    """The owner reaped the server itself: the sweeper has nothing left to do."""
    if sweeper is not None and sweeper.poll() is None:
        sweeper.terminate()
        sweeper.wait()


def _uptime_ticks() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * _CLOCK_TICKS) + 1


def sweep(server_pid: int, started: int) -> int:
    """Wait for the server (pid `server_pid`, started at `started` ticks after boot) to end, then reap what it left:
    its stubs, and the shared memory of every stub of it seen meanwhile (one that exits by itself may leave its
    region). Returns how many stubs had to be killed."""
    try:
        fd = os.pidfd_open(server_pid)
    except ProcessLookupError:
        fd = None
    stat = proc_stat(server_pid)
    regions: set[str] = set()
    if fd is not None and stat is not None and stat.started == started and stat.alive:
        while True:
            regions |= {s.shm_region for s in stub_processes(server_pid)}
            if select.select([fd], [], [], LOOK_SECONDS)[0]:  # readable once the server has exited
                break
    if fd is not None:
        os.close(fd)
    # the stubs it started: those born before it ended (or before the process that took its pid since was born)
    ended = stat.started if stat is not None and stat.started != started else _uptime_ticks()
    stubs = [s for s in stub_processes(server_pid) if s.started <= ended]
    regions |= {s.shm_region for s in stubs}
    deadline = time.monotonic() + GRACE_SECONDS
    while any(alive(s.pid) for s in stubs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return reap(server_pid, regions, born_before=ended)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        server_pid, started = int(args[0]), int(args[1])
    except (IndexError, ValueError):
        print("usage: python3 -m aot.serving.supervision.sweeper SERVER_PID SERVER_START_TICKS", file=sys.stderr)
        return 2
    killed = sweep(server_pid, started)
    if killed:
        print(f"sweeper: tritonserver {server_pid} is gone; killed {killed} of its python stubs that outlived it "
              "and removed their shared memory", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
