"""The torch engine: the served backbone in PyTorch, the task pool's rows beside it on the same device.

A batch's bias is gathered from the pool buffer inside the encoder's forward (aot.serving_torch.encoder.BiasedEncoder:
each token's pool slot picks its row, layer by layer), so rows never travel between processes or devices once they
are in the pool. On CUDA the encoder runs in fp16 and each (batch, sequence) bucket is captured at start-up as a CUDA
graph whose inputs are the token tensors and each token's slot, and whose gather reads the pool buffer in place; on
CPU it runs eagerly in fp32 (what `aot predict` runs), padded to the batch's longest sequence.

A batch whose rows the pool does not all hold (no pool, a version that left the manifest, a batch larger than the
pool) brings its own rows; such a batch runs eagerly on a rows tensor assembled for it.

With device heads (aot.serving_torch.heads: on CUDA by default, AOT_DEVICE_HEADS), the pooled kinds' heads run
inside the same forward (and graph), so a batch's answers come back as [B, n] logits; pooled states are copied back
only for items answered on the host (an embedding, a token task, a head no slot takes).

Importing this module registers the engine as `torch` (aot.serving.engine.find_engine), with its pool storage
(DeviceRows): the model files that run `engine: torch` import it before they build their step.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from aot import settings
from aot.serving import protocol
from aot.serving.engine import EncoderBatch, EncoderOutput, Engine, register_engine
from aot.serving_torch.encoder import BiasedEncoder, additive_mask, load_encoder, pool_states
from aot.serving_torch.heads import DeviceHeads

DEVICES = ("cpu", "cuda")
# device heads per step instance by default (AOT_DEVICE_HEADS): on CUDA, slots for this many task versions' heads; on
# CPU none (the host's numpy heads run on the same cores, without a gather of every item's weights)
DEFAULT_DEVICE_HEADS = {"cuda": 256, "cpu": 0}
# Encoder families whose forward copies a host tensor to the device (DeBERTa-v2's log-bucketed relative positions:
# `torch.tensor(mid - 1)` in make_log_bucket_position), which CUDA graph capture forbids: they run eagerly.
NO_CUDA_GRAPHS = ("deberta-v2",)


def check_device(device: str, present: bool = True) -> str:
    """`cpu`, `cuda` or `cuda:N`; with `present`, also a CUDA device this PyTorch sees when one is asked for."""
    kind, _, number = device.partition(":")
    if kind not in DEVICES or (number and (kind == "cpu" or not number.isdigit())):
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if present and kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this PyTorch ({torch.__version__}) sees no CUDA device")
    return device


class DeviceRows:
    """Pool rows in torch memory on one device (aot.serving.pool.RowPool's storage): device memory on a GPU."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    def allocate(self, slots: int, num_layers: int, hidden_size: int) -> torch.Tensor:
        # Uninitialised, like the host pool: a slot is read only after it was filled (TorchBackbone pads with
        # filled slots; only the warm-up before a CUDA-graph capture reads slot 0 as it is, and drops the result).
        return torch.empty((slots, num_layers, hidden_size), dtype=torch.float16, device=self.device)

    def write(self, buffer: torch.Tensor, slots: np.ndarray, rows: np.ndarray) -> None:
        buffer.index_copy_(0, self._index(slots), torch.from_numpy(np.ascontiguousarray(rows)).to(self.device))

    def gather(self, buffer: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        return buffer[self._index(slots)]

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)


def bind_instance_device(args: dict, parameters: dict[str, str]) -> None:
    """A step instance on `device: cuda` makes its own GPU the current one (Triton places a KIND_GPU instance on a
    GPU: model_instance_device_id), so that `cuda` means that GPU for its engine, pool and CUDA graphs."""
    if parameters.get("device") == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(int(args.get("model_instance_device_id") or 0))


def _bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= value), None)


class TorchBackbone:
    """The encoder (AoT: with the bias gather + add before every layer, and the device heads) for batches
    (aot.serving.engine.EncoderBatch)."""

    def __init__(self, encoder_dir: Path, uses_token_type_ids: bool, aot: bool, device: str = "cpu",
                 threads: int = 0, seq_buckets: tuple[int, ...] = (), max_batch: int = 32, cuda_graphs: bool = True,
                 head_slots: int | None = None):
        """`head_slots`: device heads for this many versions (0: none; None: AOT_DEVICE_HEADS, else
        DEFAULT_DEVICE_HEADS of the device)."""
        self.device = torch.device(check_device(device))
        cuda = self.device.type == "cuda"
        if threads and not cuda:
            torch.set_num_threads(threads)
        self.dtype = torch.float16 if cuda else torch.float32
        self.encoder = load_encoder(encoder_dir, str(self.device), self.dtype)
        self.uses_token_type_ids = uses_token_type_ids
        self.names = protocol.token_inputs(uses_token_type_ids)
        self.biased = BiasedEncoder(self.encoder, uses_token_type_ids)
        self.aot = aot
        self.pool_rows: torch.Tensor | None = None  # the pool buffer on this device (set by the step)
        # CUDA graphs over (batch, sequence) buckets: batch sizes 1, 2, 4, ... up to max_batch.
        # a family whose attention masks itself (DeBERTa-v2: a boolean mask of its own) takes the 2D mask
        self.own_mask_helpers = self.encoder.config.model_type in NO_CUDA_GRAPHS
        self.graphs = cuda and cuda_graphs and bool(seq_buckets) and not self.own_mask_helpers
        self.seq_buckets = tuple(sorted(seq_buckets))
        self.batch_buckets = tuple(sorted({min(1 << k, max_batch) for k in range(max_batch.bit_length() + 1)}))
        self._captured: dict[tuple[int, int], tuple] = {}
        # batches run eagerly although graphs are on (None: an engine that replays none, CPU or a family without)
        self.eager_batches: int | None = 0 if self.graphs else None
        self.capture_errors: dict[tuple[int, int], str] = {}  # bucket -> why its capture failed: it runs eagerly
        self.graph_bytes = 0  # device memory the captured graphs reserved
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        if head_slots is None:
            head_slots = settings.DEVICE_HEADS.read()
        if head_slots is None:
            head_slots = DEFAULT_DEVICE_HEADS[self.device.type]
        hidden = int(self.encoder.config.hidden_size)
        self.heads = DeviceHeads(head_slots, hidden, self.device, self.dtype) if head_slots else None

    def _on_device(self):
        """Make this engine's GPU the current one (kernels, capture streams), so that cuda:N works."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def capture_all(self) -> list[tuple[int, int]]:
        """Capture every bucket now (at start-up) rather than on the first request of each: a capture synchronizes
        the device and runs two warm-up passes. Returns the buckets that will run eagerly instead."""
        if self.graphs:
            with self._on_device():
                for shape in sorted(self.graph_shapes()):
                    self._try_capture(shape)
        return sorted(self.capture_errors)

    # --- one batch ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: EncoderBatch) -> EncoderOutput:
        """The pooled states [B, K, d] (fp32; aot.serving_torch.encoder.pool_states) of a batch, the token states of
        the sequences that want them, and the device heads' outputs (batch.head_slots); copied to the host once
        each, only what the batch reads."""
        slots = self.aot and batch.rows is None  # batch.index holds pool slots: the pool's buffer is read in place
        with self._on_device():
            if not self.aot or slots:
                shape = self._shape(batch.size, batch.width)
                feeds = self._feeds(batch, shape)
                if self.graphs and shape in self.graph_shapes() and self._try_capture(shape):
                    out = self._replay(shape, feeds)
                else:
                    self._count_eager()
                    out = self._forward({k: v.to(self.device) for k, v in feeds.items()}, self.pool_rows)
            else:
                self._count_eager()
                rows = torch.cat([r.to(self.device) if isinstance(r, torch.Tensor) else
                                  torch.from_numpy(np.ascontiguousarray(r)).to(self.device) for r in batch.rows])
                feeds = self._feeds(batch, (batch.size, batch.width))
                out = self._forward({k: v.to(self.device) for k, v in feeds.items()}, rows)
            return self._to_host(batch, *out)

    def _to_host(self, batch: EncoderBatch, pooled, states, logits) -> EncoderOutput:
        n = batch.size
        on_host = batch.head_slots is None or logits is None or bool((batch.head_slots < 0).any())
        return EncoderOutput(pooled[:n].float().cpu().numpy() if on_host else None,
                       states[:n].float().cpu().numpy() if batch.want_states.any() else None,
                       None if logits is None or batch.head_slots is None else logits[:n].cpu().numpy())

    def _count_eager(self) -> None:
        if self.eager_batches is not None:
            self.eager_batches += 1

    def _shape(self, batch: int, seq: int) -> tuple[int, int]:
        """The padded shape: a captured bucket on CUDA, else exactly the batch and its longest sequence."""
        if self.graphs:
            b, s = _bucket(batch, self.batch_buckets), _bucket(seq, self.seq_buckets)
            if b is not None and s is not None:
                return b, s
        return batch, seq

    def graph_shapes(self):
        return {(b, s) for b in self.batch_buckets for s in self.seq_buckets}

    def _feeds(self, batch: EncoderBatch, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        """Host tensors of `shape`, the batch's own arrays when it has that shape (one copy to the device per batch,
        none here): tokens right-padded (a padded row attends to its first position only), for AoT each token's row
        (batch.index: a padded position takes its sequence's first row, a padded row the batch's first), and each
        item's head slot (any slot for one answered on the host: its outputs are not read)."""
        n, w = batch.size, batch.width
        arrays = {name: batch.tokens[name] for name in self.names}
        if self.aot:
            arrays["index"] = batch.index
        if self.heads is not None:
            arrays["head_slots"] = np.maximum(batch.head_slots if batch.head_slots is not None else
                                              np.zeros(n, np.int64), 0)
        if shape != (n, w):
            grown = {}
            for name, array in arrays.items():
                if name == "head_slots":
                    grown[name] = np.zeros(shape[0], np.int64)
                    grown[name][:n] = array
                    continue
                fill = int(array[0, 0]) if name == "index" else 0
                grown[name] = np.full(shape, fill, dtype=np.int64)
                grown[name][:n, :w] = array
                if name == "index":
                    grown[name][:n, w:] = array[:, :1]
            grown[protocol.ATTENTION_MASK][n:, 0] = 1
            arrays = grown
        return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for k, v in arrays.items()}

    def _forward(self, feeds: dict[str, torch.Tensor], rows: torch.Tensor | None):
        """The pooled states [B, K, d], every token's final state [B, S, d] and the device heads' outputs (None
        without): on the device alone, nothing read back to the host or copied from it (what a CUDA graph captures;
        tests/test_torch_engine.py checks it under a guard), the attention mask made here (additive_mask) rather
        than by transformers."""
        ids, mask = feeds[protocol.INPUT_IDS], feeds[protocol.ATTENTION_MASK]
        types = feeds.get(protocol.TOKEN_TYPE_IDS)
        attention = mask if self.own_mask_helpers else additive_mask(mask, self.dtype)
        if not self.aot:
            states = self.biased.plain_states(ids, attention, types)
        else:
            states = self.biased.states(ids, attention, types, rows, feeds["index"])
        pooled = pool_states(states, mask)
        logits = self.heads.forward(pooled, feeds["head_slots"]) if self.heads is not None else None
        return pooled, states, logits

    # --- CUDA graphs ----------------------------------------------------------------------------------------------

    def _try_capture(self, shape: tuple[int, int]) -> bool:
        """Whether the bucket has a graph, capturing it if it was never tried; a capture that fails is reported once
        and the bucket runs eagerly from then on (a failed request would fail again at every retry)."""
        if shape in self._captured:
            return True
        if shape in self.capture_errors:
            return False
        try:
            self._captured[shape] = self._capture(shape)
            return True
        except RuntimeError as exc:
            self.capture_errors[shape] = " ".join(str(exc).split())[:300]
            print(f"torch engine: CUDA graph capture failed for bucket {shape}; it runs eagerly ({exc})",
                  file=sys.stderr, flush=True)
            return False

    def _replay(self, shape: tuple[int, int], feeds: dict[str, torch.Tensor]) -> tuple:
        """Copy the inputs into the bucket's static tensors and replay its graph."""
        graph, static, out = self._captured[shape]
        for name, value in feeds.items():
            static[name].copy_(value, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, shape: tuple[int, int]):
        """Capture the forward for one bucket. The pool buffer is read in place, so rows filled later are seen."""
        static = {n: torch.zeros(shape, dtype=torch.int64, device=self.device) for n in self.names}
        static[protocol.ATTENTION_MASK][:, 0] = 1
        if self.aot:
            static["index"] = torch.zeros(shape, dtype=torch.int64, device=self.device)
        if self.heads is not None:
            static["head_slots"] = torch.zeros(shape[0], dtype=torch.int64, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up runs before capture (lazy initialisation must not be captured)
            for _ in range(2):
                self._forward(static, self.pool_rows)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=side):
            out = self._forward(static, self.pool_rows)
        return graph, static, out

    def captured(self) -> list[tuple[int, int]]:
        """The (batch, sequence) buckets captured so far."""
        return sorted(self._captured)


def _torch_backbone(step, aot: bool, threads: int, log: Callable[[str], None] | None = None,
                    heads: bool = True) -> TorchBackbone:
    """A served step's torch backbone (aot.serving.stages.Encoder) on its parameter `device`, reading the step's task
    pool in place, with device heads if `heads` (AOT_DEVICE_HEADS); every bucket's CUDA graph is captured now, not
    on live requests."""
    repo, options = step.repo, step.options
    backbone = TorchBackbone(repo.encoder_dir, repo.uses_token_type_ids, aot, step.parameters["device"], threads,
                             options.buckets, options.max_batch_size, head_slots=None if heads else 0)
    if step.pool is not None:
        backbone.pool_rows = step.pool.buffer
    before = torch.cuda.memory_reserved(backbone.device) if backbone.graphs else 0
    eager = backbone.capture_all()
    backbone.graph_bytes = torch.cuda.memory_reserved(backbone.device) - before if backbone.graphs else 0
    if log is not None:
        if backbone.graphs:
            log(f"{step.name}: {len(backbone.captured())} CUDA graphs captured ({backbone.graph_bytes} bytes of "
                "device memory)")
        if backbone.heads is not None:
            log(f"{step.name}: device heads for {backbone.heads.capacity} task versions ({backbone.heads.bytes} "
                "bytes)")
    step.facts(device=str(backbone.device), cuda_graphs=len(backbone.captured()), graph_bytes=backbone.graph_bytes,
               device_head_slots=0 if backbone.heads is None else backbone.heads.capacity,
               device_head_bytes=0 if backbone.heads is None else backbone.heads.bytes)
    if eager:  # never a silent fallback: the server log's warning, and a line of the supervisor's /ready
        why = next(iter(backbone.capture_errors.values()), "")
        step.warn(f"CUDA graph capture failed for {len(eager)} of {len(backbone.graph_shapes())} (batch, sequence) "
                  f"buckets, which run eagerly: {eager} (first error: {why})")
    return backbone


register_engine(Engine("torch", _torch_backbone, storage=DeviceRows, gathers_slots=True))
