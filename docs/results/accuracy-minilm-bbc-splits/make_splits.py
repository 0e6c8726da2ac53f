"""Write BBC News re-split with other seeds as data folders, for the cross-split comparison in docs/benchmarks.md
section 3.3: the same corpus and the same 80/10/10 stratified split as the built-in `bbc_news` (whose seed is 13),
with split seeds 1-4, so that each method is scored on other test texts too.

    python docs/results/accuracy-minilm-bbc-splits/make_splits.py runs/bbc-splits
"""
import json
import sys
from pathlib import Path

from sklearn.model_selection import train_test_split

from training.data import builtin


def write_split(examples, labels, seed: int, folder: Path) -> None:
    y = [ex.label for ex in examples]
    rest, test = train_test_split(examples, test_size=builtin.TEST_FRACTION, random_state=seed, stratify=y)
    train, dev = train_test_split(rest, test_size=builtin.DEV_FRACTION / (1 - builtin.TEST_FRACTION),
                                  random_state=seed, stratify=[ex.label for ex in rest])
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("dev", dev), ("test", test)):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for ex in part:
                f.write(json.dumps({"text": ex.text, "label": ex.label}) + "\n")
    (folder / "task.json").write_text(json.dumps({"name": f"bbc_news_split{seed}", "labels": list(labels),
                                                  "metric": "accuracy"}))


def main(out: str) -> None:
    data = builtin.bbc_news()
    examples = data.train + data.dev + data.test
    for seed in (1, 2, 3, 4):
        write_split(examples, data.spec.labels, seed, Path(out) / f"split{seed}")


if __name__ == "__main__":
    main(sys.argv[1])
