"""The regression and pair data sets the int8 accuracy benchmark trains on, beside the built-in Rotten Tomatoes and
BBC News (docs/benchmarks.md, "int8 on CPU"): written as `aot train --data` folders, so that the benchmark's four
tasks can be trained again from the packaged data alone.

    python -m aot.benchmarks.accuracy.int8_data --out runs/int8/data      # then rt_score/ and bbc_pairs/ under it

- `rt_score`: Rotten Tomatoes as a regression (`label` 1.0 for a positive review, 0.0 for a negative one; its
  `task.json` declares the problem, so the numbers are never read as two class names), in the built-in split.
- `bbc_pairs`: two BBC News articles of one split, labelled `same` when they share a topic and `different` when they
  do not, half of each; `--pairs` of them from the training articles and `--dev-pairs` from the dev articles.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from aot.training.data.builtin import SPLIT_SEED, bbc_news, rotten_tomatoes
from aot.training.data.task import Example


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def rt_score(out: Path) -> None:
    """Rotten Tomatoes' train and dev splits with each label as a number."""
    data = rotten_tomatoes()
    out.mkdir(parents=True, exist_ok=True)
    (out / "task.json").write_text(json.dumps({"problem": "regression"}) + "\n", encoding="utf-8")
    for split in ("train", "dev"):
        write_jsonl(out / f"{split}.jsonl", [{"text": ex.text, "label": float(ex.label == "positive")}
                                             for ex in data.splits[split]])


def article_pairs(articles: list[Example], count: int, rng: random.Random) -> list[dict]:
    """`count` pairs of distinct articles, alternately of one topic (`same`) and of two (`different`)."""
    by_topic: dict[str, list[Example]] = {}
    for ex in articles:
        by_topic.setdefault(ex.label, []).append(ex)
    rows = []
    for k in range(count):
        first = rng.choice(articles)
        same = k % 2 == 0
        others = [ex for topic, group in by_topic.items() if (topic == first.label) == same for ex in group
                  if ex is not first]
        second = rng.choice(others)
        rows.append({"text": first.text, "text_pair": second.text, "label": "same" if same else "different"})
    return rows


def bbc_pairs(out: Path, pairs: int, dev_pairs: int, seed: int = SPLIT_SEED) -> None:
    """Pairs of training articles for train.jsonl, pairs of dev articles for dev.jsonl."""
    data, rng = bbc_news(), random.Random(seed)
    write_jsonl(out / "train.jsonl", article_pairs(data.train, pairs, rng))
    write_jsonl(out / "dev.jsonl", article_pairs(data.dev, dev_pairs, rng))


def _at_least_two(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 2, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aot.benchmarks.accuracy.int8_data",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder to write rt_score/ and bbc_pairs/ into")
    parser.add_argument("--pairs", type=_at_least_two, default=2000, help="training pairs of BBC articles")
    parser.add_argument("--dev-pairs", type=_at_least_two, default=300, help="dev pairs of BBC articles")
    args = parser.parse_args(argv)
    rt_score(args.out / "rt_score")
    bbc_pairs(args.out / "bbc_pairs", args.pairs, args.dev_pairs)
    print(f"int8_data: wrote {args.out / 'rt_score'} and {args.out / 'bbc_pairs'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
