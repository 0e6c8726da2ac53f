"""`aot bench overhead`: the paper's inference-overhead comparison (section 4.4, Figure 3), side by side in one run.

Every method is timed as the multi-task-capable computation a server would run, on one shared encoder:

    vanilla       the plain encoder (also the cost of BitFit and of fused LoRA)
    aot-fused     AoT with a fused table: host lookup of the batch's distinct tokens (memory-mapped table), rows
                  and index to the device, one gather + add per layer. The lookup is inside the timed region.
    aot-dense     (--engine onnxruntime) aot-fused in the dense bias interface: the exported graph takes each
                  token's row [B, S, L, d] instead of the distinct rows + index (serving option bias_interface)
    aot-factored  AoT computing its rows on the fly from the FC factors (rank --rank)
    lora          unfused LoRA on query/value with per-row adapters (batched low-rank matmuls, rank --rank)
    adapter       Houlsby adapters with per-row weights (bottleneck --adapter-rank)
    prompt        P-Tuning v1: p prompt vectors per row before the input (sequence S + p)
    prefix        P-Tuning v2: p key/value prefixes per row in every layer

Timing: warm-up, then rounds in which every method runs once, in a rotating order (A B C, B C A, ...); the ratio to
vanilla is taken round by round and its median reported, so that drift of the machine cancels out.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.report import markdown_table, new_figure, save_figure, write_json, write_text
from serving import protocol
from training.backbone import Architecture, architecture_for, encoder_from_config, load_encoder
from training.methods.aot_ptuning.config import FCConfig
from training.methods.aot_ptuning.layer import FCPrompt
from serving_torch.encoder import BiasedEncoder, pool_states

METHODS = ("vanilla", "aot-fused", "aot-dense", "aot-factored", "lora", "adapter", "prompt", "prefix")


def _model_configs() -> dict[str, Callable]:
    from transformers import BertConfig, DebertaV2Config, RobertaConfig

    return {
        "bert-base": lambda: BertConfig(),
        "roberta-base": lambda: RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1,
                                              pad_token_id=1),
        "roberta-large": lambda: RobertaConfig(vocab_size=50265, hidden_size=1024, num_hidden_layers=24,
                                               num_attention_heads=16, intermediate_size=4096,
                                               max_position_embeddings=514, type_vocab_size=1, pad_token_id=1),
        "deberta-v2-xlarge": lambda: DebertaV2Config(vocab_size=128100, hidden_size=1536, num_hidden_layers=24,
                                                     num_attention_heads=24, intermediate_size=6144,
                                                     max_position_embeddings=512, type_vocab_size=0,
                                                     relative_attention=True, position_buckets=256,
                                                     pos_att_type=["p2c", "c2p"], position_biased_input=False,
                                                     norm_rel_ebd="layer_norm", share_att_key=True),
    }


def load_model(name: str, attn_implementation: str = "eager") -> torch.nn.Module:
    """`minilm` (the real weights) or a random model of a named shape (speed needs no trained weights).

    On CUDA, BERT/RoBERTa use SDPA attention (the fast GPU kernel; with no mask it builds none, so the forward can be
    captured in a CUDA graph); DeBERTa-v2 has only its own attention."""
    if name == "minilm" or Path(name).is_dir():
        return load_encoder(name, attn_implementation)
    configs = _model_configs()
    if name not in configs:
        raise ValueError(f"unknown model {name!r}: expected minilm or one of {', '.join(configs)}")
    config = configs[name]()
    if config.model_type == "deberta-v2":
        attn_implementation = "eager"
    return encoder_from_config(config, attn_implementation)


@dataclass
class OverheadConfig:
    models: list[str]
    batches: list[int]
    seqs: list[int]
    methods: list[str]
    engine: str = "torch"  # torch | onnxruntime
    device: str = "cpu"
    cuda_graphs: bool = False
    rank: int = 8  # LoRA rank and FC rank of aot-factored
    adapter_rank: int = 64
    prompt_length: int = 20
    warmup: int = 3
    repeats: int = 20
    out: str = "runs/bench"
    dtype: str = "auto"  # fp16 on cuda, fp32 on cpu


@dataclass
class Case:
    """One (model, batch, seq) and its inputs on the device."""

    encoder: torch.nn.Module
    arch: Architecture
    batch: int
    seq: int
    device: torch.device
    dtype: torch.dtype
    ids: torch.Tensor
    mask: torch.Tensor
    token_types: torch.Tensor | None
    ids_host: np.ndarray = field(repr=False, default=None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _encode(case: Case, inputs_embeds=None, attention_mask=None, **kw) -> torch.Tensor:
    """Benchmark inputs are unpadded, so no mask is passed (transformers then skips its data-dependent padding
    check, a host sync that CUDA graphs cannot capture); methods that lengthen the input pass theirs."""
    inputs = {"input_ids": case.ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    if case.token_types is not None:
        inputs["token_type_ids"] = case.token_types if inputs_embeds is None else torch.zeros(
            inputs_embeds.shape[:2], dtype=torch.long, device=case.device)
    hidden = case.encoder(**inputs, attention_mask=attention_mask, **kw).last_hidden_state
    return pool_states(hidden, attention_mask)  # what the AoT methods' BiasedEncoder returns, at the same cost


class Method:
    """A runnable method: `setup` (hooks, weights; untimed), `__call__` (timed), `teardown` (untimed)."""

    name = ""

    def __init__(self, case: Case, config: OverheadConfig):
        self.case, self.config = case, config

    def setup(self) -> None:
        pass

    def teardown(self) -> None:
        pass

    def __call__(self) -> torch.Tensor:
        raise NotImplementedError


class Vanilla(Method):
    name = "vanilla"

    def __call__(self):
        return _encode(self.case)


class AotFused(Method):
    """The fused table, then the biased encoder.

    CPU: the server's lookup, timed: distinct tokens of the batch, their rows read from the memory-mapped table.
    CUDA: the table is resident in device memory and gathered by token id inside the forward; no host work and no
    transfer. (A host lookup plus a per-batch copy of the rows, the CPU design, measured 1.5-7x on an H100.)
    """

    name = "aot-fused"

    def __init__(self, case, config, table: np.ndarray, resident: torch.Tensor | None = None):
        super().__init__(case, config)
        self.table, self.resident = table, resident

    def setup(self):
        self.biased = BiasedEncoder(self.case.encoder, self.case.arch.uses_token_type_ids(self.case.encoder.config))

    def teardown(self):
        self.biased.remove_hooks()

    def lookup(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.resident is not None:
            return self.resident, self.case.ids
        ids = self.case.ids_host
        unique, inverse = np.unique(ids, return_inverse=True)
        rows = torch.from_numpy(np.ascontiguousarray(self.table[unique]))
        return rows, torch.from_numpy(inverse.reshape(ids.shape).astype(protocol.INDEX_DTYPE))

    def __call__(self):
        rows, index = self.lookup()
        c = self.case
        return self.biased(c.ids, None, c.token_types, rows, index)


class AotFactored(Method):
    name = "aot-factored"

    def setup(self):
        c = self.case
        L, d = len(c.arch.layers(c.encoder)), c.encoder.config.hidden_size
        self.prompt = FCPrompt(FCConfig(rank=self.config.rank), L, d, embedding_std=0.05).to(c.device, c.dtype).eval()
        with torch.no_grad():
            self.prompt.w2.normal_(0, 0.02)
        self.biased = BiasedEncoder(c.encoder, c.arch.uses_token_type_ids(c.encoder.config))
        self.embeddings = c.encoder.get_input_embeddings().weight

    def teardown(self):
        self.biased.remove_hooks()

    def __call__(self):
        c = self.case
        unique, inverse = torch.unique(c.ids, return_inverse=True)
        return self.biased(c.ids, None, c.token_types, self.prompt.rows(unique, self.embeddings), inverse)


class _PerRowHooks(Method):
    """Per-row (per-request) low-rank weights attached by forward hooks for the timed call only."""

    sites: tuple[str, ...] = ()
    rank = 8

    def _weights(self, d: int, r: int):
        c = self.case
        g = torch.Generator(device="cpu").manual_seed(0)
        down = (torch.randn(c.batch, d, r, generator=g) * 0.02).to(c.device, c.dtype)
        up = (torch.randn(c.batch, r, d, generator=g) * 0.02).to(c.device, c.dtype)
        return down, up

    def setup(self):
        c = self.case
        self.handles = []
        for layer in c.arch.layers(c.encoder):
            for site in self.sites:
                module = layer.get_submodule(site)
                down, up = self._weights(module.in_features if self.name == "lora" else module.out_features, self.rank)
                self.handles.append(module.register_forward_hook(self._hook(down, up)))

    def teardown(self):
        for h in self.handles:
            h.remove()

    def __call__(self):
        return _encode(self.case)


class LoraUnfused(_PerRowHooks):
    name = "lora"

    def setup(self):
        c = self.case
        self.sites = tuple(n for n, m in c.arch.layers(c.encoder)[0].named_modules()
                           if n.split(".")[-1] in c.arch.lora_targets)
        self.rank = self.config.rank
        super().setup()

    @staticmethod
    def _hook(down, up):
        def hook(module, args, out):
            x = args[0]
            if x.shape[0] != down.shape[0]:  # DeBERTa projects its shared relative embeddings (batch 1) too
                return out + x @ down[0] @ up[0]
            return out + torch.bmm(torch.bmm(x, down), up)
        return hook


class AdapterPerRow(_PerRowHooks):
    name = "adapter"

    def setup(self):
        self.sites = self.case.arch.adapter_sites
        self.rank = self.config.adapter_rank
        super().setup()

    @staticmethod
    def _hook(down, up):
        def hook(module, args, out):
            return out + torch.bmm(F.gelu(torch.bmm(out, down)), up)
        return hook


class PromptV1(Method):
    name = "prompt"

    def setup(self):
        c, p = self.case, self.config.prompt_length
        d = c.encoder.config.hidden_size
        self.prompts = torch.randn(c.batch, p, d, device=c.device, dtype=c.dtype) * 0.02
        self.embed = c.encoder.get_input_embeddings()

    def __call__(self):
        c = self.case
        embeds = torch.cat([self.prompts, self.embed(c.ids)], dim=1)
        return _encode(c, inputs_embeds=embeds)


class PrefixV2(Method):
    name = "prefix"

    def setup(self):
        c, p = self.case, self.config.prompt_length
        if c.arch.model_type == "deberta-v2":
            raise NotImplementedError("prefix tuning is not supported for deberta-v2 (no key/value cache)")
        cfg = c.encoder.config
        heads, d = cfg.num_attention_heads, cfg.hidden_size
        shape = (c.batch, heads, p, d // heads)
        self.kv = [(torch.randn(shape, device=c.device, dtype=c.dtype), torch.randn(shape, device=c.device, dtype=c.dtype))
                   for _ in range(cfg.num_hidden_layers)]

    def __call__(self):
        from transformers import DynamicCache

        c = self.case
        cache = DynamicCache()
        for i, (k, v) in enumerate(self.kv):
            cache.update(k, v, i)
        return _encode(c, past_key_values=cache, use_cache=False)


class CudaGraph(Method):
    """A method captured in a CUDA graph; host-side work (the AoT lookup) stays outside and fills static buffers."""

    def __init__(self, inner: Method):
        super().__init__(inner.case, inner.config)
        self.inner, self.name = inner, inner.name

    def setup(self):
        self.inner.setup()
        c = self.case
        if isinstance(self.inner, AotFused):
            body = self.inner  # the table is resident: the gather is part of the graph
        elif isinstance(self.inner, AotFactored):
            inner = self.inner
            flat = c.ids.reshape(-1)
            positions = torch.arange(flat.numel(), device=c.device).reshape(c.ids.shape)
            body = lambda: inner.biased(c.ids, None, c.token_types, inner.prompt.rows(flat, inner.embeddings),  # noqa: E731
                                        positions)
        else:
            body = self.inner
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = body()

    def teardown(self):
        self.inner.teardown()

    def __call__(self):
        self.graph.replay()
        return self.output


METHOD_CLASSES = {"vanilla": Vanilla, "aot-fused": AotFused, "aot-factored": AotFactored, "lora": LoraUnfused,
                  "adapter": AdapterPerRow, "prompt": PromptV1, "prefix": PrefixV2}


def fused_table(vocab: int, layers: int, hidden: int, folder: Path) -> np.ndarray:
    """A [V, L, d] fp16 table as served: memory-mapped from disk (a sparse file: its content does not matter)."""
    path = folder / f"table-{vocab}-{layers}-{hidden}.npy"
    if not path.exists():
        table = np.lib.format.open_memmap(path, mode="w+", dtype=protocol.ROWS_DTYPE, shape=(vocab, layers, hidden))
        table[:: max(1, vocab // 64)] = 0.01  # touch a few pages so that the file is a real table
        table.flush()
        del table
    return np.load(path, mmap_mode="r")


def make_case(encoder, batch: int, seq: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Case:
    arch = architecture_for(encoder.config)
    vocab = encoder.config.vocab_size
    # Zipf-distributed ids, like words in text: the number of distinct tokens per batch (what a lookup moves) is
    # realistic, not the near B*S of uniform ids.
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(np.minimum(rng.zipf(1.2, size=(batch, seq)) + 4, vocab - 1).astype(np.int64))
    mask = torch.ones(batch, seq, dtype=torch.long)
    types = torch.zeros(batch, seq, dtype=torch.long) if arch.uses_token_type_ids(encoder.config) else None
    return Case(encoder, arch, batch, seq, device, dtype, ids.to(device), mask.to(device),
                None if types is None else types.to(device), ids.numpy())


def time_methods(methods: dict[str, Method], warmup: int, repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Rounds of every method once, in rotating order; returns per-method times (ms), aligned by round."""
    names = list(methods)
    times = {n: [] for n in names}
    if not names:
        return times
    with torch.inference_mode():
        for r in range(warmup + repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                m = methods[n]
                m.setup()
                _sync(device)
                start = time.perf_counter()
                m()
                _sync(device)
                elapsed = (time.perf_counter() - start) * 1e3
                m.teardown()
                if r >= warmup:
                    times[n].append(elapsed)
    return times


def size_records(methods: list[str], times: dict[str, list[float]], skipped: dict[str, str], common: dict,
                 ) -> list[dict]:
    """One record per method of one (model, batch, seq): median time, spread, and the ratio to vanilla taken round
    by round (both ran in the same round) and summarized by its median."""
    base = times.get("vanilla")
    records = []
    for name in methods:
        record = {**common, "method": name}
        if name in skipped or name not in times:
            records.append({**record, "median_ms": None, "ratio_to_vanilla": None,
                            "skipped": skipped.get(name, "not run")})
            continue
        t = times[name]
        ratios = [a / b for a, b in zip(t, base)] if base else []
        records.append({**record, "median_ms": round(statistics.median(t), 4),
                        "p10_ms": round(float(np.percentile(t, 10)), 4),
                        "p90_ms": round(float(np.percentile(t, 90)), 4),
                        "ratio_to_vanilla": round(statistics.median(ratios), 4) if ratios else None,
                        "ratio_p10": round(float(np.percentile(ratios, 10)), 4) if ratios else None,
                        "ratio_p90": round(float(np.percentile(ratios, 90)), 4) if ratios else None})
    return records


def run_torch(config: OverheadConfig, progress: bool = True, on_size: Callable[[list[dict]], None] = lambda r: None,
              ) -> list[dict]:
    from tqdm.auto import tqdm

    device = torch.device(config.device)
    dtype = {"auto": torch.float16 if device.type == "cuda" else torch.float32, "fp16": torch.float16,
             "fp32": torch.float32, "bf16": torch.bfloat16}[config.dtype]
    records = []
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-"))
    sizes = [(b, s) for b in config.batches for s in config.seqs]
    bar = tqdm(total=len(config.models) * len(sizes), desc="overhead", disable=not progress)
    for model_name in config.models:
        encoder = load_model(model_name, "sdpa" if device.type == "cuda" else "eager").to(device, dtype).eval()
        L = len(architecture_for(encoder.config).layers(encoder))
        d, V = encoder.config.hidden_size, encoder.config.vocab_size
        table = fused_table(V, L, d, scratch)
        resident = None  # on CUDA the table lives in device memory, copied once per model
        if device.type == "cuda" and "aot-fused" in config.methods:
            resident = torch.from_numpy(np.array(table)).to(device)
        for batch, seq in sizes:
            case = make_case(encoder, batch, seq, device, dtype)
            methods, skipped = {}, {}
            for name in config.methods:
                if name not in METHOD_CLASSES:
                    skipped[name] = "an input interface of the exported graphs: --engine onnxruntime"
                    continue
                cls = METHOD_CLASSES[name]
                method = cls(case, config, table, resident) if cls is AotFused else cls(case, config)
                try:
                    if config.cuda_graphs:
                        method = CudaGraph(method)
                    method.setup()
                    with torch.inference_mode():
                        method()
                    method.teardown()
                    methods[name] = method
                except (NotImplementedError, RuntimeError, ValueError) as exc:
                    skipped[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            if config.cuda_graphs:  # graphs were captured in the trial run above; keep them (setup is capture)
                for m in methods.values():
                    m.setup = lambda: None  # noqa: E731
                    m.teardown = lambda: None  # noqa: E731
            times = time_methods(methods, config.warmup, config.repeats, device)
            common = {"model": model_name, "batch": batch, "seq": seq, "engine": "torch", "device": device.type,
                      "dtype": str(dtype).removeprefix("torch."), "cuda_graphs": config.cuda_graphs,
                      "repeats": config.repeats}
            records += size_records(config.methods, times, skipped, common)
            on_size(records)
            bar.update(1)
        del encoder, resident
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return records


# --- ONNX Runtime: the exported graphs a server runs --------------------------------------------------------------

def _ort_graphs(backbone, folder: Path, methods: list[str], device: torch.device) -> tuple[dict[str, Path], str]:
    """The exporter's graphs the methods need (vanilla, AoT in the rows interface, AoT in the dense interface) and
    their dtype. On CUDA their fp16 twins, what the NGC image's onnxruntime backend runs, if every twin keeps parity;
    else all in fp32, so that no ratio compares an fp16 graph with an fp32 one."""
    from exporter.onnx_export import export_backbone_graph, export_fp16_graph

    wanted = {"vanilla": (False, "rows"), "aot": (True, "rows"), "aot-dense": (True, "dense")}
    need = {"vanilla"} | ({"aot"} if {"aot-fused", "aot-factored"} & set(methods) else set()) | (
        {"aot-dense"} & set(methods))
    graphs = {name: export_backbone_graph(backbone, folder / name, aot=wanted[name][0],
                                          interface=wanted[name][1]).optimized for name in sorted(need)}
    if device.type != "cuda":
        return graphs, "float32"
    twins = {name: export_fp16_graph(backbone, graph, *wanted[name])[0] for name, graph in graphs.items()}
    missed = sorted(name for name, twin in twins.items() if twin is None)
    if missed:
        print(f"overhead: the fp16 twin of {', '.join(missed)} misses parity: every graph runs in fp32",
              file=sys.stderr, flush=True)
        return graphs, "float32"
    return twins, "float16"


_NUMPY_TYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float16: np.float16, torch.float32: np.float32}


class BoundSession:
    """An ONNX Runtime session whose inputs and output are bound in place to torch tensors on `device` (IO binding):
    nothing is copied through the host, as in Triton's native backends, where the lookup's tensors arrive in device
    memory. CUDA needs onnxruntime-gpu (its CUDA execution provider)."""

    def __init__(self, path: Path, device: torch.device, threads: int = 0):
        import onnxruntime as ort

        provider = "CUDAExecutionProvider" if device.type == "cuda" else "CPUExecutionProvider"
        if provider not in ort.get_available_providers():
            raise ValueError(f"--engine onnxruntime --device {device.type} needs onnxruntime with {provider} "
                             f"(this onnxruntime has {', '.join(ort.get_available_providers())}): install "
                             "onnxruntime-gpu")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options_cuda = [{"device_id": device.index or 0}] if device.type == "cuda" else None
        self.session = ort.InferenceSession(str(path), options, providers=[provider], provider_options=options_cuda)
        self.device = device
        self.inputs = {i.name for i in self.session.get_inputs()}

    def run(self, feeds: dict[str, torch.Tensor], hidden: int) -> torch.Tensor:
        """The pooled states [B, P, d] (fp32, on the device) of `feeds` (the graph's inputs, on the device)."""
        bound = {name: tensor.contiguous() for name, tensor in feeds.items() if name in self.inputs}  # alive to the end
        _sync(self.device)  # inputs written on torch's stream (copies included) before ONNX Runtime reads them
        binding = self.session.io_binding()
        kind, index = self.device.type, self.device.index or 0
        for name, t in bound.items():
            binding.bind_input(name, kind, index, _NUMPY_TYPES[t.dtype], tuple(t.shape), t.data_ptr())
        out = torch.empty((feeds[protocol.INPUT_IDS].shape[0], len(protocol.POOLINGS), hidden), dtype=torch.float32,
                          device=self.device)
        binding.bind_output(protocol.POOLED_HIDDEN, kind, index, np.float32, tuple(out.shape), out.data_ptr())
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()  # ONNX Runtime's stream done: the timer may stop
        return out


def device_bias_feeds(case: Case, table: torch.Tensor, interface: str) -> dict[str, torch.Tensor]:
    """What the GPU ensemble hands the native backbone for this batch, built as the server builds it: per request,
    its distinct tokens and index on the host (serving.tasks.token_index, what the lookup step computes), its rows
    gathered from the table resident on the device, then the requests' tensors concatenated as Triton's batcher
    concatenates them into the backbone's inputs: every request's rows + index + the accumulated row offsets, or
    every request's dense bias (serving.protocol.dense_bias)."""
    from serving.tasks import token_index

    rows, index = [], []
    for ids, mask in zip(case.ids_host, case.mask.cpu().numpy()):
        unique, local = token_index(ids, mask)
        rows.append(table[torch.from_numpy(unique).to(table.device)])
        index.append(local)
    if interface == "dense":
        return {protocol.AOT_BIAS: torch.stack([protocol.dense_bias(r, i) for r, i in zip(rows, index)])}
    offsets = np.concatenate([[0], np.cumsum([r.numel() for r in rows])]).astype(protocol.INDEX_DTYPE)
    return {protocol.AOT_ROWS: torch.cat([r.reshape(-1) for r in rows]),
            protocol.AOT_INDEX: torch.from_numpy(np.stack(index)).to(table.device),
            protocol.AOT_ROW_OFFSETS: torch.from_numpy(offsets).to(table.device)}


def run_onnxruntime(config: OverheadConfig, progress: bool = True,
                    on_size: Callable[[list[dict]], None] = lambda r: None) -> list[dict]:
    """vanilla and AoT through the exporter's optimized graphs, AoT in both bias interfaces (aot-fused: rows + index;
    aot-dense: each token's row). On CPU, the server's own lookup and batching code (serving.tasks, serving.engine),
    the lookup inside the timed region. On CUDA, the fp16 graphs with the table resident on the device and the
    inputs bound in place (BoundSession); the device lookup is inside the timed region. Other methods run with
    --engine torch."""
    from tqdm.auto import tqdm

    from serving.engine import BackboneRunner, Prepared
    from exporter.rows_export import write_rows_graphs
    from serving.store import EMBEDDINGS
    from serving.tasks import FactoredRows, ServedTask, lookup
    from training.backbone import Backbone

    device = torch.device(config.device)
    records = []
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-ort-"))
    sizes = [(b, s) for b in config.batches for s in config.seqs]
    bar = tqdm(total=len(config.models) * len(sizes), desc="overhead (onnxruntime)", disable=not progress)
    for model_name in config.models:
        encoder = load_model(model_name).eval()
        backbone = Backbone(model_name, encoder, None, "bench")
        L, d, V = backbone.num_layers, backbone.hidden_size, encoder.config.vocab_size
        table = fused_table(V, L, d, scratch)
        graphs, graph_dtype = _ort_graphs(backbone, scratch / model_name, config.methods, device)
        if device.type == "cuda":
            sessions = {k: BoundSession(g, device) for k, g in graphs.items()}
            resident = torch.from_numpy(np.array(table)).to(device)
        else:
            runners_by_graph = {k: BackboneRunner(g) for k, g in graphs.items()}
            prompt = FCPrompt(FCConfig(rank=config.rank), L, d, embedding_std=0.05).eval()
            factors = {k: v.detach().numpy() for k, v in prompt.state_dict().items()}
            store = scratch / model_name / "store"
            write_rows_graphs(store, L, d)
            np.save(store / EMBEDDINGS, encoder.get_input_embeddings().weight.detach().numpy())
            # the served table's guard (a stat before each read of the map) is timed as the server runs it
            served = {"fused": ServedTask("fused", "fused@000000000000", None, 512, "fused", L, d, V, {},
                                          table=table, table_path=Path(table.filename),
                                          table_bytes=os.path.getsize(table.filename)),
                      "factored": ServedTask("factored", "factored@000000000000", None, 512, "factored", L, d, V,
                                             {}, compute_rows=FactoredRows(store, {"method": "fc", "activation": "tanh"},
                                                                           factors))}
        for batch, seq in sizes:
            case = make_case(encoder, batch, seq, device, torch.float32)
            if device.type == "cuda":
                tokens = {protocol.INPUT_IDS: case.ids, protocol.ATTENTION_MASK: case.mask}
                if case.token_types is not None:
                    tokens[protocol.TOKEN_TYPE_IDS] = case.token_types
                run = lambda graph, bias=None: sessions[graph].run(  # noqa: E731
                    {**tokens, **(device_bias_feeds(case, resident, bias) if bias else {})}, d)
                runners = {"vanilla": lambda: run("vanilla"), "aot-fused": lambda: run("aot", "rows"),
                           "aot-dense": lambda: run("aot-dense", "dense")}
            else:
                requests = [Prepared({protocol.INPUT_IDS: case.ids[b].numpy(),
                                      protocol.ATTENTION_MASK: case.mask[b].numpy()}
                                     | ({protocol.TOKEN_TYPE_IDS: case.token_types[b].numpy()}
                                        if case.token_types is not None else {}))
                            for b in range(batch)]

                def served_path(task: ServedTask, graph: str):
                    """What the CPU server's fused step does for this batch: lookup, then the graph."""
                    looked_up = []
                    for t in requests:
                        rows, index = lookup(task, t.tokens[protocol.INPUT_IDS], t.tokens[protocol.ATTENTION_MASK])
                        looked_up.append(Prepared(t.tokens, index=index, rows=rows))
                    return runners_by_graph[graph].run(looked_up)

                runners = {"vanilla": lambda: runners_by_graph["vanilla"].run(requests),
                           "aot-fused": lambda: served_path(served["fused"], "aot"),
                           "aot-factored": lambda: served_path(served["factored"], "aot"),
                           "aot-dense": lambda: served_path(served["fused"], "aot-dense")}
            methods = {n: _Callable(n, r) for n, r in runners.items() if n in config.methods}
            skipped = {n: "the onnxruntime engine times vanilla and AoT graphs only; use --engine torch for the others"
                       for n in config.methods if n not in runners}
            if "aot-factored" in skipped and device.type == "cuda":
                skipped["aot-factored"] = "the onnxruntime engine on cuda times fused tables (the factored rows are " \
                                          "computed by the lookup step, not the graph)"
            times = time_methods(methods, config.warmup, config.repeats, device)
            common = {"model": model_name, "batch": batch, "seq": seq, "engine": "onnxruntime", "device": device.type,
                      "dtype": graph_dtype, "cuda_graphs": False,
                      "repeats": config.repeats}
            records += size_records(config.methods, times, skipped, common)
            on_size(records)
            bar.update(1)
    bar.close()
    return records


class _Callable(Method):
    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn

    def __call__(self):
        return self.fn()


# --- reports ----------------------------------------------------------------------------------------------------

def write_reports(records: list[dict], out: Path, title: str) -> None:
    write_json(out / "overhead.json", records)
    rows = []
    for r in records:
        rows.append({**r, "ratio": "-" if r["ratio_to_vanilla"] is None else f"{r['ratio_to_vanilla']:.3f}",
                     "spread": "" if r.get("ratio_p10") is None else f"{r['ratio_p10']:.3f}-{r['ratio_p90']:.3f}",
                     "ms": "-" if r["median_ms"] is None else f"{r['median_ms']:.3f}"})
    text = f"# {title}\n\n" + markdown_table(
        rows, ["model", "engine", "device", "batch", "seq", "method", "ms", "ratio", "spread"],
        ["model", "engine", "device", "batch", "seq", "method", "median ms", "× vanilla", "ratio p10-p90"])
    skipped = sorted({(r["method"], r["skipped"]) for r in records if r.get("skipped")})
    if skipped:
        text += "\nNot run: " + "; ".join(f"{m} ({why})" for m, why in skipped) + "\n"
    write_text(out / "overhead.md", text)
    _plot(records, out / "overhead.png", title)


def _plot(records: list[dict], path: Path, title: str) -> None:
    sizes = sorted({(r["model"], r["batch"], r["seq"]) for r in records})
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    fig, ax = new_figure(max(8, 0.6 * len(sizes) + 3), 4.5)
    width = 0.8 / max(1, len(methods))
    for k, method in enumerate(methods):
        values = []
        for size in sizes:
            match = [r for r in records if (r["model"], r["batch"], r["seq"]) == size and r["method"] == method]
            values.append(match[0]["ratio_to_vanilla"] if match and match[0]["ratio_to_vanilla"] else np.nan)
        ax.bar(np.arange(len(sizes)) + k * width, values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(sizes)) + width * (len(methods) - 1) / 2)
    ax.set_xticklabels([f"{m}\nb{b} s{s}" for m, b, s in sizes], fontsize=7)
    ax.set_ylabel("time / vanilla")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=min(4, len(methods)))
    save_figure(fig, path)


def run_overhead(config: OverheadConfig, progress: bool = True) -> dict:
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}: expected some of {', '.join(METHODS)}")
    if "vanilla" not in config.methods:
        config.methods = ["vanilla", *config.methods]
    if config.cuda_graphs and config.device != "cuda":
        raise ValueError("--cuda-graphs needs --device cuda")
    if config.cuda_graphs and config.engine != "torch":
        raise ValueError("--cuda-graphs applies to --engine torch")
    if config.dtype != "auto" and config.engine != "torch":
        raise ValueError(f"--dtype {config.dtype} applies to --engine torch; --engine onnxruntime runs the exported "
                         "graphs a server runs (fp16 twins on cuda where all keep parity, fp32 on cpu)")
    runner = run_torch if config.engine == "torch" else run_onnxruntime
    out = Path(config.out)
    graphs = " + CUDA graphs" if config.cuda_graphs else ""
    title = f"Inference overhead, {config.engine}{graphs} on {config.device}"
    # reports are rewritten after every size: an interrupted run keeps what it measured
    records = runner(config, progress, on_size=lambda recs: write_reports(recs, out, title))
    return {"out": str(out), "records": len(records), "config": asdict(config)}
