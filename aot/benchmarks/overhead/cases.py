"""What both engines of `aot bench overhead` share: the configuration, the models, the cases (a model at one batch
size and sequence length, with its inputs), the Method interface, the rotating timer and the records it gives."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from aot.serving import protocol
from aot.training.backbone import Architecture, architecture_for, encoder_from_config, load_encoder

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
    precision: str = "fp32"  # --engine onnxruntime on cpu: fp32 graphs, or their int8 twins (aot.exporter.quantize)
    threads: int = 0  # --engine onnxruntime on cpu: ONNX Runtime threads per graph (0: as the CPU server runs one)


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
                sync(device)
                start = time.perf_counter()
                m()
                sync(device)
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
        ratios = [a / b for a, b in zip(t, base, strict=True)] if base else []
        records.append({**record, "median_ms": round(statistics.median(t), 4),
                        "p10_ms": round(float(np.percentile(t, 10)), 4),
                        "p90_ms": round(float(np.percentile(t, 90)), 4),
                        "ratio_to_vanilla": round(statistics.median(ratios), 4) if ratios else None,
                        "ratio_p10": round(float(np.percentile(ratios, 10)), 4) if ratios else None,
                        "ratio_p90": round(float(np.percentile(ratios, 90)), 4) if ratios else None})
    return records

