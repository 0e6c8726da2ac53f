"""The served side of `aot bench gpu-perf`: `aot serve` started as a user starts it, and what its metrics and
health ports say."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVE_START_S = 300.0  # `aot serve` until it prints its endpoints (it waits for readiness itself)


def metric_sum(text: str, name: str) -> float | None:
    """A counter summed over its series in Prometheus text; None when the server publishes no series of it."""
    values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)", text, re.M)
    return sum(float(v) for v in values) if values else None


def _get(url: str) -> str:
    """GET a URL's body (the body of an error answer too: /ready answers 503 with its reasons)."""
    try:
        return urllib.request.urlopen(url, timeout=10).read().decode()
    except urllib.error.HTTPError as exc:
        return exc.read().decode()


class Served:
    """`aot serve --vanilla` on a repository, as a user starts it: its endpoints and admin key from the JSON line it
    prints once ready, its log beside the results."""

    def __init__(self, repo: Path, device: str, pool: int | None, folder: Path):
        from aot.local.server import free_ports

        grpc, http, metrics, health = free_ports(4)
        folder.mkdir(parents=True, exist_ok=True)
        self.command = [sys.executable, "-m", "aot", "serve", "--repo", str(repo), "--device", device, "--vanilla",
                        *(["--pool-bytes", str(pool)] if pool is not None else []), "--grpc-port", str(grpc),
                        "--http-port", str(http), "--metrics-port", str(metrics), "--health-port", str(health),
                        "--log", str(folder / "tritonserver.log")]
        self.stderr = (folder / "serve.log").open("w")
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                        start_new_session=True)
        self.info = self._endpoints()
        self.grpc_url = self.info["grpc"]
        self.admin_key = Path(self.info["admin_key_file"]).read_text().strip()

    def _endpoints(self) -> dict:
        end = time.monotonic() + SERVE_START_S
        while time.monotonic() < end and self.process.poll() is None:
            ready, _, _ = select.select([self.process.stdout], [], [], 1.0)
            if ready:
                line = self.process.stdout.readline()
                if line.startswith("{"):
                    return json.loads(line)
        code = self.process.poll()
        self.stop()
        raise RuntimeError((f"aot serve exited with {code}" if code is not None else
                            f"aot serve did not serve within {SERVE_START_S:.0f} s") + f" (its log: {self.stderr.name})")

    def metrics(self) -> str:
        return _get(f"http://{self.info['metrics']}/metrics")

    def ready(self) -> dict:
        return json.loads(_get(f"http://{self.info['health']}/ready"))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # aot serve stops its server and exits
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.stderr.close()
