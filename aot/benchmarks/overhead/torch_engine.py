"""`aot bench overhead --engine torch`: every method in PyTorch on one shared encoder, eager or replayed as CUDA
graphs."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from aot.benchmarks.overhead.cases import (
    Case,
    Method,
    OverheadConfig,
    fused_table,
    load_model,
    make_case,
    size_records,
    time_methods,
)
from aot.serving import protocol
from aot.serving_torch.encoder import BiasedEncoder, pool_states
from aot.training.backbone import architecture_for
from aot.training.methods.aot_ptuning.config import FCConfig
from aot.training.methods.aot_ptuning.layer import FCPrompt


def _encode(case: Case, inputs_embeds=None, attention_mask=None, **kw) -> torch.Tensor:
    """Benchmark inputs are unpadded, so no mask is passed (transformers then skips its data-dependent padding
    check, a host sync that CUDA graphs cannot capture); methods that lengthen the input pass theirs."""
    inputs = {"input_ids": case.ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    if case.token_types is not None:
        inputs["token_type_ids"] = case.token_types if inputs_embeds is None else torch.zeros(
            inputs_embeds.shape[:2], dtype=torch.long, device=case.device)
    hidden = case.encoder(**inputs, attention_mask=attention_mask, **kw).last_hidden_state
    return pool_states(hidden, attention_mask)  # what the AoT methods' BiasedEncoder returns, at the same cost


class Vanilla(Method):
    name = "vanilla"

    def __call__(self):
        return _encode(self.case)


class AotFused(Method):
    """The fused table, then the biased encoder.

    CPU: the server's lookup, timed: distinct tokens of the batch, their rows read from the memory-mapped table.
    CUDA: the table is resident in device memory and gathered by token id inside the forward; no host work and no
    transfer (the CPU design on a GPU, a host lookup plus a per-batch copy of the rows: docs/benchmarks.md, "Inference overhead").
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

            def body():
                return inner.biased(c.ids, None, c.token_types, inner.prompt.rows(flat, inner.embeddings), positions)
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
                    m.setup = lambda: None
                    m.teardown = lambda: None
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
