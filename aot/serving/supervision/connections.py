"""A stopping server's open HTTP connections, closed by its supervisor.

Triton 2.51's HTTP front end has no idle or read timeout (server src/http_server.cc: no evhtp timeouts), and its stop
first waits, a second at a time, for every open HTTP connection to close, counting that wait against
--exit-timeout-secs, the same budget it then has to finish in-flight requests and unload its models
(HTTPServer::Stop, then InferenceServer::Stop). One client that keeps a connection open (idle keep-alive, or a request
that never finished arriving: POST headers and 10 bytes of body) used the whole budget, and every graceful stop
ended "Exit timeout expired. Exiting immediately" (issue 57.3), while gRPC kept accepting meanwhile.

By the time they are closed the server accepts no new HTTP connection (it was signalled) and its steps answered every
request they had accepted (aot.serving.supervision.lifecycle), so what is closed holds no accepted work. The
supervisor takes a copy of each connection's descriptor (pidfd_getfd, Linux 5.6; the server is its child) and shuts
the socket down, which the server then sees as a closed connection. Where the kernel or a seccomp profile refuses
that (Docker's default profile allows pidfd_getfd only with CAP_SYS_PTRACE), the server's own wait bounds the stop:
--exit-timeout-secs, with nothing accepted left to cut off.
"""

from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path

_PIDFD_GETFD = 438  # the same number on every Linux architecture
_TCP_STATES = {"01", "08"}  # ESTABLISHED, CLOSE_WAIT (the client sent its FIN; the server has not closed yet)


def _inodes(pid: int, port: int) -> set[int]:
    """The socket inodes of the connections on local TCP port `port` in `pid`'s network namespace."""
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] in _TCP_STATES and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(fields[9]))
    return found


def connections(pid: int, port: int) -> list[int]:
    """The descriptors (in `pid`) of its TCP connections on local port `port`: the clients of the server it runs on
    that port."""
    inodes = _inodes(pid, port)
    fds = []
    try:
        entries = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:[") and int(target[8:-1]) in inodes:
            fds.append(int(entry.name))
    return sorted(fds)


def close_connections(pid: int, port: int) -> int:
    """Shut down every connection of `pid` on local port `port` (connections); how many. OSError (PermissionError
    where pidfd_getfd is refused) when it cannot."""
    fds = connections(pid, port)
    if not fds:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    closed = 0
    try:
        for fd in fds:
            copy = libc.syscall(_PIDFD_GETFD, pidfd, fd, 0)
            if copy < 0:
                errno = ctypes.get_errno()
                if errno == 9:  # EBADF: that connection closed meanwhile
                    continue
                raise OSError(errno, f"pidfd_getfd of tritonserver's descriptor {fd}: {os.strerror(errno)}")
            with socket.socket(fileno=copy) as connection:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                    closed += 1
                except OSError:  # not connected any more
                    pass
    finally:
        os.close(pidfd)
    return closed
