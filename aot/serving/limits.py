"""How large one request may be, from a repository's serving options, and how far a step's shared memory may grow.

Triton 2.51 bounds the batch dimension only (max_batch_size, checked before any backend runs). It takes gRPC
messages up to 2 GiB (MAX_GRPC_MESSAGE_SIZE is INT32_MAX, no flag: `tritonserver --help` lists none, and
front_end_args has none to set), HTTP bodies of any size (`--http-max-input-size` arrives in 2.59), and no upper bound
on a variable dimension (`dims: -1`); a python step refuses an oversized request only after the backend copied it into
the step's shared-memory region, which grows to hold it and never shrinks while the stub lives (docs/security.md,
"Bounded requests"). So:
- the fleet's load balancer refuses a body larger than `body_bytes` before any replica reads it (aot.local.fleet);
- the supervisor replaces an instance whose region holds more than its bound (aot.serving.supervision.supervisor):
  memory returns to its baseline after an oversized request that reached a server directly. A step whose region
  holds only clients' requests and their answers (CLIENT_STEPS: the fused CPU step, task_list, the GPU tokenizer) is
  bound by those (`client_region_bytes`, about 30 MiB by default); a step between steps also holds a batch's
  tensors (`region_bytes`). A request too small to pass either bound leaves at most that bound per instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aot import settings
from aot.serving import protocol
from aot.serving.repository import RepositoryInfo, largest_batch_bytes, read_repository

KIB, MIB = 1 << 10, 1 << 20
FRAMING_BYTES = 16 * KIB  # tensor names, shapes and types, the task name, protobuf or JSON framing
DIGITS_PER_ID = 21  # a token id written in JSON: up to 19 digits, a sign and a comma
REGION_FLOOR = 64 * MIB  # the least a region may hold before it counts as grown (the backend's own queues, slack)
CLIENT_REGION_FLOOR = 16 * MIB  # the same for a step of CLIENT_STEPS (measured: 1 MiB at start and under load)
CLIENT_STEPS = ("aot", "vanilla", "task_list", "tokenizer")  # models whose stubs take clients' requests alone


@dataclass(frozen=True)
class RequestBounds:
    body_bytes: int  # the largest request body: max_request_bytes, or one item (two texts, or the ids) if larger
    region_bytes: int  # a python step's shared memory holding more than this held an oversized request
    client_region_bytes: int  # the same for a step of CLIENT_STEPS

    def region_of(self, model: str) -> int:
        """The bound of the region of a stub of `model` (0: none)."""
        return self.client_region_bytes if model in CLIENT_STEPS else self.region_bytes


def request_bounds(info: RepositoryInfo) -> RequestBounds:
    """The repository's bounds: an item holds TEXT and TEXT_PAIR (max_text_bytes each) or token ids up to the
    longest sequence served (as JSON text, the larger encoding) and its TASK; a request body holds items up to
    max_request_bytes (a request of many texts: aot.serving.columns), at least one whole item; a region holds a full
    batch of items twice over (inputs of one batch while the last one's are freed) and its answers (each smaller than
    its request), and a step between steps the batch's tensors too. AOT_SHM_REGION_BYTES sets both."""
    texts = 2 * info.options.max_text_bytes
    ids = len(protocol.token_inputs(True)) * info.max_positions * DIGITS_PER_ID
    item = max(texts, ids) + FRAMING_BYTES
    body = max(info.options.max_request_bytes, item)
    requests = 3 * info.options.max_batch_size * item
    override = settings.SHM_REGION_BYTES.read()
    if override is not None:
        return RequestBounds(body, override, override)
    return RequestBounds(body, REGION_FLOOR + requests + largest_batch_bytes(info), CLIENT_REGION_FLOOR + requests)


def region_bound_of(models_dir: str | Path) -> RequestBounds | None:
    """The shared-memory bounds for a server of the model repository `models_dir` (REPO/models; `region_of(model)`);
    None when it is not an AoT repository, or the bound is turned off (AOT_SHM_REGION_BYTES=0)."""
    try:
        bounds = request_bounds(read_repository(Path(models_dir).parent))
    except (ValueError, OSError):
        return None
    return bounds if bounds.region_bytes else None
