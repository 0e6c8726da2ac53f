"""Write BBC News re-split with other seeds as data folders, for the cross-split comparison in docs/benchmarks.md
section 3.3: the built-in `bbc_news` split (training.data.builtin.split, seed 13) with split seeds 1-4, so that each
method is scored on other test texts too.

    python docs/results/accuracy-minilm-bbc-splits/make_splits.py runs/bbc-splits
"""
import json
import sys
from pathlib import Path

from training.data import builtin


def main(out: str) -> None:
    data = builtin.bbc_news()
    examples = data.train + data.dev + data.test
    for seed in (1, 2, 3, 4):
        folder = Path(out) / f"split{seed}"
        folder.mkdir(parents=True, exist_ok=True)
        resplit = builtin.split(f"bbc_news_split{seed}", examples, data.spec.labels, data.spec.metric, seed=seed)
        for name in ("train", "dev", "test"):
            with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
                for ex in getattr(resplit, name):
                    f.write(json.dumps({"text": ex.text, "label": ex.label}) + "\n")
        (folder / "task.json").write_text(json.dumps({"name": resplit.spec.name, "labels": list(data.spec.labels),
                                                      "metric": data.spec.metric}))


if __name__ == "__main__":
    main(sys.argv[1])
