"""`aot bench overhead --engine onnxruntime`: vanilla and AoT through the exported graphs a server runs."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from aot.benchmarks.overhead.cases import (
    Case,
    Method,
    OverheadConfig,
    fused_table,
    load_model,
    make_case,
    size_records,
    sync,
    time_methods,
)
from aot.serving import protocol
from aot.serving.engine import cpu_session
from aot.training.methods.aot_ptuning.config import FCConfig
from aot.training.methods.aot_ptuning.layer import FCPrompt


def _ort_graphs(backbone, folder: Path, methods: list[str], device: torch.device,
                precision: str = "fp32") -> tuple[dict[str, Path], str]:
    """The exporter's graphs the methods need (vanilla, AoT in the rows interface, AoT in the dense interface) and
    their dtype. On CUDA their fp16 twins, what the NGC image's onnxruntime backend runs, if every twin keeps parity;
    else all in fp32, so that no ratio compares an fp16 graph with an fp32 one. `precision` int8: their int8 twins
    (CPU)."""
    from aot.exporter.onnx_export import export_backbone_graph, export_fp16_graph

    wanted = {"vanilla": (False, "rows"), "aot": (True, "rows"), "aot-dense": (True, "dense")}
    need = {"vanilla"} | ({"aot"} if {"aot-fused", "aot-factored"} & set(methods) else set()) | (
        {"aot-dense"} & set(methods))
    graphs = {name: export_backbone_graph(backbone, folder / name, aot=wanted[name][0],
                                          interface=wanted[name][1]).optimized for name in sorted(need)}
    if precision == "int8":  # what an int8 repository's CPU configs run
        from aot.exporter.quantize import quantize_graph
        from aot.serving.repository import INT8_GRAPH

        for name, graph in graphs.items():
            quantize_graph(graph, graph.with_name(INT8_GRAPH))
        return {name: graph.with_name(INT8_GRAPH) for name, graph in graphs.items()}, "int8"
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
        if device.type == "cuda":
            options = ort.SessionOptions()
            if threads:
                options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            self.session = ort.InferenceSession(str(path), options, providers=[provider],
                                                provider_options=[{"device_id": device.index or 0}])
        else:  # with the CPU engine's graph optimizations
            self.session = cpu_session(path, threads)
        self.device = device
        self.inputs = {i.name for i in self.session.get_inputs()}

    def run(self, feeds: dict[str, torch.Tensor], hidden: int) -> torch.Tensor:
        """The pooled states [B, P, d] (fp32, on the device) of `feeds` (the graph's inputs, on the device)."""
        bound = {name: tensor.contiguous() for name, tensor in feeds.items() if name in self.inputs}  # alive to the end
        sync(self.device)  # inputs written on torch's stream (copies included) before ONNX Runtime reads them
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
    its distinct tokens and index on the host (aot.serving.tasks.token_index, what the lookup step computes), its rows
    gathered from the table resident on the device, then the requests' tensors concatenated as Triton's batcher
    concatenates them into the backbone's inputs: every request's rows + index + the accumulated row offsets, or
    every request's dense bias (its rows[index])."""
    from aot.serving.tasks import token_index

    rows, index = [], []
    for ids, mask in zip(case.ids_host, case.mask.cpu().numpy(), strict=True):
        unique, local = token_index(ids, mask)
        rows.append(table[torch.from_numpy(unique).to(table.device)])
        index.append(local)
    if interface == "dense":
        return {protocol.AOT_BIAS: torch.stack([r[torch.as_tensor(i, device=r.device).long()]
                                                for r, i in zip(rows, index, strict=True)])}
    offsets = np.concatenate([[0], np.cumsum([r.numel() for r in rows])]).astype(protocol.INDEX_DTYPE)
    return {protocol.AOT_ROWS: torch.cat([r.reshape(-1) for r in rows]),
            protocol.AOT_INDEX: torch.from_numpy(np.stack(index)).to(table.device),
            protocol.AOT_ROW_OFFSETS: torch.from_numpy(offsets).to(table.device)}


def cpu_threads(config: OverheadConfig) -> int:
    """ONNX Runtime threads per graph on CPU: --threads, else what one instance of the CPU server's fused step runs
    with the repository defaults (the cores shared among --cpu-instances' default), so that the ratios are those of
    the served path. With more than one, every small operator of the AoT graph wakes the sleeping pool threads
    (aot.serving.engine.BackboneRunner: no spinning), which costs more than the operator's work at batch 1
    (docs/benchmarks.md, "int8 on CPU")."""
    from aot.serving.engine import instance_threads
    from aot.serving.repository import ServingOptions

    return config.threads or instance_threads(ServingOptions().cpu_instances)


class _Callable(Method):
    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn

    def __call__(self):
        return self.fn()


def run_onnxruntime(config: OverheadConfig, progress: bool = True,
                    on_size: Callable[[list[dict]], None] = lambda r: None) -> list[dict]:
    """vanilla and AoT through the exporter's optimized graphs, AoT in both bias interfaces (aot-fused: rows + index;
    aot-dense: each token's row). On CPU, the server's own lookup and batching code (aot.serving.tasks,
    aot.serving.engine), the lookup inside the timed region. On CUDA, the fp16 graphs with the table resident on the
    device and the inputs bound in place (BoundSession); the device lookup is inside the timed region. Other methods run
    with --engine torch."""
    from tqdm.auto import tqdm

    from aot.exporter.rows_export import write_rows_graphs
    from aot.serving.columns import TaskColumn
    from aot.serving.engine import BackboneRunner, EncoderBatch
    from aot.serving.stages import find_rows
    from aot.serving.store.layout import TABLE_BLOCKS
    from aot.serving.store.reader import EMBEDDINGS
    from aot.serving.store.table_blocks import TableBlocks, VerifiedTable, block_list
    from aot.serving.tasks import FactoredRows, ServedTask
    from aot.training.backbone import Backbone

    device = torch.device(config.device)
    threads = cpu_threads(config)
    records = []
    scratch = Path(tempfile.mkdtemp(prefix="aot-bench-ort-"))
    sizes = [(b, s) for b in config.batches for s in config.seqs]
    bar = tqdm(total=len(config.models) * len(sizes), desc="overhead (onnxruntime)", disable=not progress)
    for model_name in config.models:
        encoder = load_model(model_name).eval()
        backbone = Backbone(model_name, encoder, None, "bench")
        L, d, V = backbone.num_layers, backbone.hidden_size, encoder.config.vocab_size
        table = fused_table(V, L, d, scratch)
        graphs, graph_dtype = _ort_graphs(backbone, scratch / model_name, config.methods, device, config.precision)
        if device.type == "cuda":
            sessions = {k: BoundSession(g, device) for k, g in graphs.items()}
            resident = torch.from_numpy(np.array(table)).to(device)
        else:
            # int8 graphs run one request at a time, as served (aot.exporter.quantize)
            runners_by_graph = {k: BackboneRunner(g, threads=threads, per_request=graph_dtype == "int8")
                                for k, g in graphs.items()}
            prompt = FCPrompt(FCConfig(rank=config.rank), L, d, embedding_std=0.05).eval()
            factors = {k: v.detach().numpy() for k, v in prompt.state_dict().items()}
            store = scratch / model_name / "store"
            write_rows_graphs(store, L, d)
            np.save(store / EMBEDDINGS, encoder.get_input_embeddings().weight.detach().numpy())
            # the served table's reads by verified blocks are timed as the server runs them
            blocks = TableBlocks.parse(memoryview(block_list(Path(table.filename))), TABLE_BLOCKS)
            served = {"fused": ServedTask("fused", "fused@000000000000", None, 512, "fused", L, d, V, {},
                                          table=VerifiedTable(Path(table.filename), blocks, "fused@000000000000")),
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
                tokens = {protocol.INPUT_IDS: case.ids.numpy(), protocol.ATTENTION_MASK: case.mask.numpy()} | (
                    {protocol.TOKEN_TYPE_IDS: case.token_types.numpy()} if case.token_types is not None else {})
                plain = EncoderBatch.joined([tokens])

                def served_path(task: ServedTask, graph: str):
                    """What the CPU server's fused step does for this batch: lookup, then the graph."""
                    batch = EncoderBatch.joined([tokens])
                    find_rows(batch, TaskColumn([task], np.zeros(batch.size, np.int64)), task.vocab_size)
                    return runners_by_graph[graph].run(batch)

                runners = {"vanilla": lambda: runners_by_graph["vanilla"].run(plain),
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
                      "repeats": config.repeats, **({"threads": threads} if device.type == "cpu" else {})}
            records += size_records(config.methods, times, skipped, common)
            on_size(records)
            bar.update(1)
    bar.close()
    return records
