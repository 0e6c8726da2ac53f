"""Figures for the Python API (docs/benchmarks.md, "The Python API"), on the packaged MiniLM, CPU:

1. the same task trained by `aot train` and by transformers.Trainer through get_aot_model: same data (Rotten
   Tomatoes, our split), seed, steps, batch, rate and schedule: dev accuracy and seconds;
2. MultiTaskModel: texts/s with one task, and with 8 tasks mixed in every batch.

    python -m aot.benchmarks.python_api --out runs/python-api [--steps 200] [--texts 512]

Prints one JSON object and writes it to OUT/results.json, with the 1-minute load average around each measurement
(the machine these figures come from is shared: seconds are comparable only at similar load).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

MAX_LENGTH, BATCH, LR, SEED = 64, 16, 1e-3, 0


def aot_train(out: Path, steps: int) -> dict:
    from aot.training.api import train_task

    load = os.getloadavg()[0]
    summary = train_task(model="minilm", data="rotten_tomatoes", method="fc", out=str(out), max_length=MAX_LENGTH,
                         max_steps=steps, batch_size=BATCH, lr=LR, seed=SEED, progress=False)
    return {"dev": summary["dev"], "seconds": summary["train_seconds"], "load_average": [load, os.getloadavg()[0]]}


def trainer(out: Path, steps: int) -> dict:
    """What a transformers user writes (README, "Bring your own training loop"), with aot train's settings: Adam
    (AdamW without decay), linear warm-up over 10 % of the steps then linear decay, the head reading the pooling
    MiniLM declares (AotConfig pooling None)."""
    from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

    from aot import AotConfig, get_aot_model, model_path
    from aot.training.data import load_task_data

    path = model_path("minilm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = load_task_data("rotten_tomatoes")
    labels = list(data.spec.labels)

    def encode(examples):
        return [{**tokenizer(ex.text, truncation=True, max_length=MAX_LENGTH), "labels": labels.index(ex.label)}
                for ex in examples]

    torch.manual_seed(SEED)  # as aot train seeds before it builds the model
    model = get_aot_model(AutoModel.from_pretrained(path, attn_implementation="eager"),
                          AotConfig(method="fc", labels=labels, max_length=MAX_LENGTH))
    args = TrainingArguments(str(out / "trainer-run"), max_steps=steps, per_device_train_batch_size=BATCH,
                             per_device_eval_batch_size=64, learning_rate=LR, weight_decay=0.0,
                             lr_scheduler_type="linear", warmup_steps=round(0.1 * steps), seed=SEED,
                             save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True)
    run = Trainer(model=model, args=args, train_dataset=encode(data.train), eval_dataset=encode(data.dev),
                  data_collator=DataCollatorWithPadding(tokenizer),
                  compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())})
    load, start = os.getloadavg()[0], time.perf_counter()
    run.train()
    dev = run.evaluate()["eval_accuracy"]
    seconds = time.perf_counter() - start
    model.save_pretrained(out / "trainer-task")
    return {"dev": dev, "seconds": round(seconds, 2), "load_average": [load, os.getloadavg()[0]]}


def multitask(out: Path, n_texts: int, n_tasks: int = 8, repeats: int = 3) -> dict:
    """Texts/s of MultiTaskModel.predict over the same texts: all on one task, and 8 tasks mixed in every batch
    (row i on task i % 8); the best of `repeats` interleaved passes each. The tasks are new FC tasks (rank 64) saved
    with save_pretrained: their values do not change the work."""
    from transformers import AutoModel

    from aot import AotConfig, MultiTaskModel, get_aot_model, model_path
    from aot.training.data import load_task_data

    path = model_path("minilm")
    tasks = {}
    for i in range(n_tasks):
        torch.manual_seed(i)
        model = get_aot_model(AutoModel.from_pretrained(path), AotConfig(method="fc", max_length=MAX_LENGTH))
        tasks[f"t{i}"] = model.save_pretrained(out / "tasks" / f"t{i}")
    multi = MultiTaskModel.from_pretrained(tasks)
    texts = [ex.text for ex in load_task_data("rotten_tomatoes").dev[:n_texts]]
    mixed = [f"t{i % n_tasks}" for i in range(len(texts))]
    multi.predict(texts, mixed)  # warm-up: the first pass over new batch shapes runs at half speed
    result = {"texts": len(texts), "batch_size": 32, "threads": torch.get_num_threads(), "repeats": repeats,
              "load_average_before": os.getloadavg()[0]}
    best = {"one_task": 0.0, "mixed_8_tasks": 0.0}
    for _ in range(repeats):  # interleaved, best of each: the machine is shared, a busy moment hits one pass
        for label, names in (("one_task", ["t0"] * len(texts)), ("mixed_8_tasks", mixed)):
            start = time.perf_counter()
            multi.predict(texts, names)
            best[label] = max(best[label], len(texts) / (time.perf_counter() - start))
    result |= {f"{label}_texts_per_s": round(rate, 1) for label, rate in best.items()}
    result["ratio_mixed_over_one"] = round(best["mixed_8_tasks"] / best["one_task"], 3)
    result["load_average_after"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--only", choices=["train", "multitask"], default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    np.random.seed(SEED)
    results = {"model": "minilm", "data": "rotten_tomatoes (our split)", "steps": args.steps, "batch_size": BATCH,
               "max_length": MAX_LENGTH, "lr": LR, "seed": SEED}
    if args.only in (None, "train"):
        results["aot_train"] = aot_train(args.out / "aot-train-task", args.steps)
        results["trainer"] = trainer(args.out, args.steps)
    if args.only in (None, "multitask"):
        results["multitask"] = multitask(args.out, args.texts)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
