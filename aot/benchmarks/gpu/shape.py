"""What a shape of `aot bench gpu-perf` serves: the repository (the encoder and 8 copies of the task), its task
pool, the texts that pad to the engine alone's bucket, and a line that describes the encoder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TASKS = tuple(f"aot-{i}" for i in range(8))
TEXTS = 64  # distinct served texts of the bucket


def describe(model_dir: Path) -> str:
    c = json.loads((model_dir / "config.json").read_text())
    return (f"{c.get('model_type', '?')} config, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']} heads, FFN {c['intermediate_size']}, vocabulary {c['vocab_size']}, random "
            "weights")


def build_repository(task: Path, repo: Path, max_batch_size: int, gpu_instances: int | None = None) -> None:
    """What `aot export backbone --format torch --max-batch-size N` and `aot export task` write: the encoder, and
    the task published as aot-0 ... aot-7 (fused; the copies hard-linked to the first's files)."""
    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.task_export import export_task
    from aot.serving.repository import ServingOptions, read_repository
    from aot.serving.store.writer import Publication, TaskStore
    from aot.training.artifact import read_task

    instances = {} if gpu_instances is None else {"gpu_instances": gpu_instances}
    export_backbone(read_task(task).backbone["model"], repo,
                    ServingOptions(engine="torch", max_batch_size=max_batch_size, **instances))
    first = export_task(task, repo, TASKS[0], "fused", progress=False)
    store = TaskStore(read_repository(repo).store_root)
    copies = []
    for name in TASKS[1:]:
        folder = store.new_version_folder(name)
        folder.rmdir()
        shutil.copytree(store.root / first.folder, folder, copy_function=os.link)
        copies.append(Publication(name, folder, "fused"))
    store.publish_many(copies)


def pool_bytes(repo: Path, device: str) -> int | None:
    """On a GPU, a pool that holds the 8 tasks' fused tables in every instance of the served step (each holds an
    equal share), and a little more. On CPU (the rehearsal) the repository's own: 8 base-size tables in each
    instance's host memory (2 x 4.5 GB) got the steps killed on the 2-core development machine."""
    from aot.serving.repository import read_repository

    if device == "cpu":
        return None
    info = read_repository(repo)
    table = info.vocab_size * info.num_layers * info.hidden_size * 2
    return info.options.gpu_instances * len(TASKS) * table + (64 << 20)


def bucket_texts(model_dir: Path, seq: int, buckets: tuple[int, ...]) -> list[str]:
    """TEXTS distinct Rotten Tomatoes reviews whose tokens pad to the `seq` bucket, as the engine alone runs."""
    from transformers import AutoTokenizer

    from aot.serving.tokenization import bucket_length
    from aot.training.data import load_task_data

    if seq not in buckets:
        raise ValueError(f"--seq {seq} is not one of the served buckets {buckets}: served texts could not pad to it")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    data = load_task_data("rotten_tomatoes")
    chosen: list[str] = []
    for example in [*data.dev, *data.train]:
        if example.text not in chosen and bucket_length(len(tokenizer(example.text)["input_ids"]), buckets) == seq:
            chosen.append(example.text)
            if len(chosen) == TEXTS:
                return chosen
    raise ValueError(f"only {len(chosen)} reviews pad to the {seq}-token bucket; expected {TEXTS}")
