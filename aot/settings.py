"""Every `AOT_*` environment variable, in one place: its type, default and meaning, and who reads it.

The project's code reads them only through the typed helpers here (`Setting.read`): a bad value is refused with
its name, the value and what was expected. The variables the scripts and deployment files read (demo.sh, compose,
Kubernetes) are listed too, so that docs/configuration.md, generated from this module (`python -m aot.settings
> docs/configuration.md`; tests/test_settings.py checks they agree), names every one. The bottom layer of `aot`:
it imports nothing of the project.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class SettingError(ValueError):
    """A variable set to a value of the wrong kind."""


def _integer(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < minimum:
            raise ValueError(raw)
        return value
    return parse


def _share(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        raise ValueError(raw)
    return value


def _non_negative(raw: str) -> float:
    """A finite number, 0 or more (seconds, a rate)."""
    value = float(raw)
    if not 0.0 <= value < float("inf"):
        raise ValueError(raw)
    return value


def _header_name(raw: str) -> str:
    """A request header's name, lower-cased (gRPC metadata keys are)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", raw.strip()):
        raise ValueError(raw)
    return raw.strip().lower()


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One variable. `parse` turns its text into the value (a ValueError: refused as not `expected`); unset or
    empty reads as `default`."""

    name: str
    meaning: str
    default: Any = None
    parse: Callable[[str], Any] = str
    expected: str = "text"
    read_by: str = ""

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            raise SettingError(f"{self.name}={raw!r}: expected {self.expected}") from None


BYTES = "a number of bytes (an integer, 0 or more)"

# --- read by the project's code ------------------------------------------------------------------------------------
URL = Setting("AOT_URL", "the server's gRPC address for `aot infer`, `aot tasks` and aot.Client when none is given",
              "127.0.0.1:8001", read_by="client")
TENANT_KEY = Setting("AOT_TENANT_KEY", "the client's tenant key when none is given (its tenant's tasks answer)",
                     read_by="client")
DEBUG = Setting("AOT_DEBUG", "a failed command prints its traceback, not only its one-line error", False, _flag,
                "1 or 0", read_by="command")
STEP_PYTHON = Setting("AOT_STEP_PYTHON", "the Python the local server's python steps run (numpy<2; default: the "
                      "Python running `aot`)", parse=str, expected="a Python executable", read_by="aot serve")
ADMIN_KEY = Setting("AOT_ADMIN_KEY", "the deployment's admin key: the control API answers only requests carrying it "
                    "(default: generated at start)", read_by="supervisor, aot serve")
ADMIN_KEY_FILE = Setting("AOT_ADMIN_KEY_FILE", "a file holding the admin key (a Docker or Kubernetes secret), read "
                         "when AOT_ADMIN_KEY is unset", expected="a file path", read_by="supervisor, aot serve")
HEALTH_PORT = Setting("AOT_HEALTH_PORT", "the supervisor's health port (/ready, /live)", 8003, _integer(1),
                      "a port number", read_by="supervisor (the container), scripts/demo.sh")
HEALTH_ADDRESS = Setting("AOT_HEALTH_ADDRESS", "the address the supervisor's health port listens on", "0.0.0.0",
                         expected="an IP address", read_by="supervisor (the container)")
DRAIN_SECONDS = Setting("AOT_DRAIN_SECONDS", "a graceful stop (SIGTERM) first drains this long: /ready answers 503 "
                        "so that load balancers send nothing new, requests that still arrive are answered; then new "
                        "requests are refused (retryable) on both protocols, those begun are finished, and the "
                        "server stops (`aot serve --drain-seconds` sets it; a second signal stops at once)", 10.0,
                        _non_negative, "a number of seconds, 0 or more",
                        read_by="supervisor (the container), aot serve")
LOAD_VANILLA = Setting("AOT_LOAD_VANILLA", "the container's server also loads the plain encoder (`vanilla`, for "
                       "comparisons: one more engine)", False, _flag, "1 or 0", read_by="supervisor (the container)")
POOL_BYTES = Setting("AOT_POOL_BYTES", "the task pool's budget of the step instances, over the repository's "
                     "(`aot serve --pool-bytes` sets it; 0: no pool)", None, _integer(0), BYTES,
                     read_by="python steps")
SHM_REGION_BYTES = Setting("AOT_SHM_REGION_BYTES", "the bound of a python step's shared memory, past which the "
                           "supervisor replaces the step (default: from the repository's limits; 0: none)", None,
                           _integer(0), BYTES, read_by="supervisor, python steps")
METRICS_TASKS = Setting("AOT_METRICS_TASKS", "tasks with metric series of their own, the busiest (the rest share "
                        "one label; 0: every task under one label; `aot serve --metrics-tasks` sets it)", 100,
                        _integer(0), "a non-negative integer", read_by="python steps")
TOKENIZER_THREADS = Setting("AOT_TOKENIZER_THREADS", "threads a python step's tokenizer encodes a batch's texts on "
                            "(default: on a GPU step, the host's cores shared among its GPU instances, at most 8: "
                            "the host's cores are otherwise idle; on a CPU step 1, the cores run the engine)", None,
                            _integer(1), "a number of threads, 1 or more", read_by="python steps")
DEVICE_HEADS = Setting("AOT_DEVICE_HEADS", "task versions whose heads (classification, regression, multi-label) a "
                       "torch engine step keeps in its device's memory and runs inside its forward, so that a batch "
                       "leaves the device as logits (default: 256 on CUDA, 0 on CPU, where the host's heads run "
                       "cheaper; 0 turns them off)", None, _integer(0), "a number of task versions, 0 or more",
                       read_by="python steps")
REQUEST_LOG = Setting("AOT_REQUEST_LOG", "the request log: one JSON line per sampled request, appended to this "
                      "file (`aot serve --request-log`)", expected="a file path", read_by="python steps")
REQUEST_LOG_SAMPLE = Setting("AOT_REQUEST_LOG_SAMPLE", "the share of texts the request log keeps (each of a "
                             "request's drawn on its own)", 1.0, _share, "a share of requests from 0 to 1",
                             read_by="python steps")
REQUEST_LOG_TEXT = Setting("AOT_REQUEST_LOG_TEXT", "the request log keeps each request's text too", False, _flag,
                           "1 or 0", read_by="python steps")
REQUIRE_TENANT_KEYS = Setting("AOT_REQUIRE_TENANT_KEYS", "public tasks too answer only requests with a tenant key "
                              "(`aot serve --require-tenant-keys` sets it)", False, _flag, "1 or 0",
                              read_by="python steps")
RATE_LIMIT = Setting("AOT_RATE_LIMIT", "texts per second each tenant (a valid tenant key) may send a server (a request of N texts "
                     "counts N), shared among the instances of its first step; more are refused with a retry hint "
                     "(`aot serve --rate-limit` sets it; 0: no limit)", 0.0, _non_negative, "a number of texts per second",
                     read_by="python steps")
ANONYMOUS_RATE_LIMIT = Setting("AOT_ANONYMOUS_RATE_LIMIT", "texts per second that all requests without a valid "
                               "tenant key may send a server together (default: AOT_RATE_LIMIT; `aot serve "
                               "--anonymous-rate-limit` sets it; 0: no limit)", None, _non_negative,
                               "a number of texts per second", read_by="python steps")
RATE_BURST_SECONDS = Setting("AOT_RATE_BURST_SECONDS", "seconds of its rate a caller may send at once after a quiet "
                             "spell (a token bucket's depth)", 1.0, _non_negative, "a number of seconds",
                             read_by="python steps")
CLIENT_ADDRESS_HEADER = Setting("AOT_CLIENT_ADDRESS_HEADER", "the request header that carries a keyless client's "
                                "address, set by a proxy in front that overwrites what clients send (the fleet's "
                                "HAProxy sets aot-client-address): keyless callers then share the anonymous rate "
                                "equally by address (unset: they are one caller; tritonserver forwards the header to "
                                "the steps, `aot serve --client-address-header` sets it)", None,
                                _header_name, "a header name (letters, digits and '-')",
                                read_by="python steps, supervisor (the container), aot serve")
TASK_CACHE_DIR = Setting("AOT_TASK_CACHE_DIR", "where a server keeps the task versions it fetched from an object "
                         "store (default: ~/.cache/aot/task-versions/<store>)", expected="a folder path",
                         read_by="python steps")
HOST_CACHE_DIR = Setting("AOT_HOST_CACHE_DIR", "the folder of the index through which a host's step processes share "
                         "the sealed copies of the task versions they loaded (default: /dev/shm/aot-task-cache-<uid>; "
                         "it must be this user's and no one else's, or each process keeps its own copies)",
                         expected="a folder path", read_by="python steps")
TASK_CACHE_BYTES = Setting("AOT_TASK_CACHE_BYTES", "the bound of that folder; the least recently used versions go "
                           "first", 20 << 30, _integer(0), BYTES, read_by="python steps")

# --- read by the scripts and deployment files ----------------------------------------------------------------------
REPO = Setting("AOT_REPO", "the repository docker compose serves (a folder on this machine)", "./runs/demo/repo",
               expected="a folder path", read_by="docker-compose.yml")
REPOSITORY = Setting("AOT_REPOSITORY", "the repository's folder on the fleet's volume", "demo",
                     expected="a folder name", read_by="deploy/kubernetes")
TASK_ARTIFACT = Setting("AOT_TASK_ARTIFACT", "the publish Job's task artifact, a folder under artifacts/ on the "
                        "volume", "sentiment", expected="a folder name", read_by="deploy/kubernetes/publish")
TASK_NAME = Setting("AOT_TASK_NAME", "the name the publish Job publishes the task under", "sentiment",
                    expected="a task name", read_by="deploy/kubernetes/publish")
CUDA_POOL_BYTES = Setting("AOT_CUDA_POOL_BYTES", "tritonserver's CUDA memory pool (REPO/compose.env sizes it from "
                          "the largest batch)", 64 << 20, _integer(0), BYTES,
                          read_by="docker-compose.yml, deploy/kubernetes")
PINNED_POOL_BYTES = Setting("AOT_PINNED_POOL_BYTES", "tritonserver's pinned memory pool (REPO/compose.env)",
                            256 << 20, _integer(0), BYTES, read_by="docker-compose.yml, deploy/kubernetes")
DEMO_DIR = Setting("AOT_DEMO_DIR", "where the demo writes its task, repository and logs", "runs/demo",
                   expected="a folder path", read_by="scripts/demo.sh")
DEMO_SAMPLES = Setting("AOT_DEMO_SAMPLES", "train the demo on this many reviews (a quick, weaker model; default: "
                       "all 10,200)", None, _integer(1), "a number of reviews", read_by="scripts/demo.sh")
GRPC_PORT = Setting("AOT_GRPC_PORT", "the demo server's gRPC port", 8001, _integer(1), "a port number",
                    read_by="scripts/demo.sh")
HTTP_PORT = Setting("AOT_HTTP_PORT", "the demo server's HTTP port", 8000, _integer(1), "a port number",
                    read_by="scripts/demo.sh")
METRICS_PORT = Setting("AOT_METRICS_PORT", "the demo server's metrics port", 8002, _integer(1), "a port number",
                       read_by="scripts/demo.sh")
TORCH_VERSION = Setting("AOT_TORCH_VERSION", "the PyTorch release set-up installs (a local CPU wheel)", "2.13.0",
                        expected="a version", read_by="scripts/setup.sh")
KIT_PYTHON = Setting("AOT_KIT_PYTHON", "the Python version the GPU kit's wheels are fetched for (the lent GPU "
                     "machine's)", "3.12", expected="a Python version", read_by="scripts/gpu-kit.sh")
GPU_KIT = Setting("AOT_GPU_KIT", "the folder of the GPU kit (wheels and data the GPU check carries)", ".gpu-kit",
                  expected="a folder path", read_by="scripts/gpu-check.sh")
GPU_WORK = Setting("AOT_GPU_WORK", "the GPU check's working folder", "/tmp/aot-gpu", expected="a folder path",
                   read_by="scripts/gpu-check.sh")
GPU_DEVICE = Setting("AOT_GPU_DEVICE", "the device the GPU check serves on (cpu rehearses its stages)", "cuda",
                     expected="a device", read_by="scripts/gpu-check.sh")
GPU_SECONDS = Setting("AOT_GPU_SECONDS", "seconds the GPU check's perf stage may take from the script's start, "
                      "set-up included: windows and shapes that would not fit are skipped and named", 450, _integer(1),
                      "a number of seconds", read_by="scripts/gpu-check.sh")
GPU_REQUESTS = Setting("AOT_GPU_REQUESTS", "requests per serve and pool measurement of the GPU check", 2000, _integer(1),
                       "a number of requests", read_by="scripts/gpu-check.sh")
GPU_ROUNDS = Setting("AOT_GPU_ROUNDS", "rounds of the GPU check's serve bench", 1, _integer(1), "a number of rounds",
                     read_by="scripts/gpu-check.sh")
GPU_INSTANCES = Setting("AOT_GPU_INSTANCES", "the GPU check's perf stage serves its step in this many instances "
                        "on the GPU", 4, _integer(1), "a number of instances, 1 or more",
                        read_by="scripts/gpu-check.sh")

SETTINGS: tuple[Setting, ...] = tuple(v for v in globals().values() if isinstance(v, Setting))
SCRIPTS_FROM = REPO  # the first setting only the scripts and deployment files read (the table's second part)


def markdown() -> str:
    """docs/configuration.md: the variables as two tables, the code's and the scripts'."""
    split = SETTINGS.index(SCRIPTS_FROM)

    def table(settings: tuple[Setting, ...]) -> list[str]:
        rows = ["| variable | default | expected | meaning | read by |", "|---|---|---|---|---|"]
        for s in settings:
            shown = int(s.default) if isinstance(s.default, bool) else s.default
            default = "(unset)" if shown is None else f"`{shown}`"
            rows.append(f"| `{s.name}` | {default} | {s.expected} | {s.meaning} | {s.read_by} |")
        return rows

    return "\n".join([
        "# Configuration: the AOT_* environment variables",
        "",
        "Generated from `aot/settings.py` (`python -m aot.settings > docs/configuration.md`); tests/test_settings.py",
        "checks that they agree. Unset and empty mean the default. A value of the wrong kind is refused with the",
        "variable's name, the value and what was expected. Command-line flags win over these where both exist",
        "(`aot serve --pool-bytes` sets `AOT_POOL_BYTES` for its steps, for example).",
        "",
        "## Read by the project's code",
        "",
        *table(SETTINGS[:split]),
        "",
        "## Read by the scripts and deployment files",
        "",
        *table(SETTINGS[split:]),
        "",
    ])


if __name__ == "__main__":
    print(markdown(), end="")
