"""Task metrics: the paper's (its Table 1), from scikit-learn and scipy, and those of the other kinds.

Scores are fractions in [0, 1] (correlations in [-1, 1]); reports multiply by 100 like the paper.
F1 is binary F1 of the second label (GLUE's positive class, e.g. MRPC/QQP "1") for two labels, macro F1 otherwise
(as for CB).

Other kinds: `entity_f1` (tokens: entity-level micro F1 by seqeval, its default lenient mode: predictions and gold
are lists of tag sequences), `micro_f1` / `macro_f1` (multilabel: 0/1 indicator matrices [N, labels]), `spearman`
(scored pairs: cosine similarities against the scores) and `recall@k` (retrieval pairs: a similarity matrix [N, N]
of anchors against positives, the gold positive of anchor i is i).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


def _f1(pred: np.ndarray, gold: np.ndarray, num_labels: int) -> float:
    if num_labels == 2:
        return float(f1_score(gold, pred, pos_label=1, average="binary", zero_division=0))
    return float(f1_score(gold, pred, labels=list(range(num_labels)), average="macro", zero_division=0))


def _entity_f1(pred, gold, n) -> float:
    from seqeval.metrics import f1_score as entity_f1  # on first use: only token tasks need it

    return float(entity_f1([list(t) for t in gold], [list(t) for t in pred]))


def _recall_at(k: int):
    def recall(similarity, gold, n) -> float:
        similarity = np.asarray(similarity)
        own = np.diagonal(similarity)[:, None]
        rank = (similarity > own).sum(axis=1)  # positives scored above the anchor's own (ties in its favour)
        return float((rank < k).mean())

    return recall


def _correlation(fn, pred: np.ndarray, gold: np.ndarray) -> float:
    if np.std(pred) == 0 or np.std(gold) == 0:
        return 0.0  # undefined for a constant prediction; scored as no correlation
    return float(fn(pred, gold)[0])


METRICS: dict[str, Callable[[np.ndarray, np.ndarray, int], float]] = {
    "accuracy": lambda p, g, n: float(accuracy_score(g, p)),
    "f1": _f1,
    "acc_f1": lambda p, g, n: (float(accuracy_score(g, p)) + _f1(p, g, n)) / 2,
    "mcc": lambda p, g, n: float(matthews_corrcoef(g, p)),
    "pearson_spearman": lambda p, g, n: (_correlation(pearsonr, p, g) + _correlation(spearmanr, p, g)) / 2,
    "entity_f1": _entity_f1,
    "micro_f1": lambda p, g, n: float(f1_score(g, p, average="micro", zero_division=0)),
    "macro_f1": lambda p, g, n: float(f1_score(g, p, average="macro", zero_division=0)),
    "spearman": lambda p, g, n: _correlation(spearmanr, p, g),
    **{f"recall@{k}": _recall_at(k) for k in (1, 5, 10)},
}
# The metrics that score each kind are its spec's (aot.serving.kinds.KindSpec.metrics), the first its default; an
# embedding task's default is spearman for scored pairs, recall@1 for retrieval pairs.
RAGGED = ("entity_f1",)  # metrics whose inputs are sequences of different lengths


def compute_metric(name: str, predictions: Sequence, gold: Sequence, num_labels: int) -> float:
    """`predictions`/`gold` by metric: label indices (classification), floats (regression, spearman), indicator
    matrices (multilabel), tag sequences (entity_f1), or for recall@k a similarity matrix and no gold."""
    if name in RAGGED:
        return METRICS[name](predictions, gold, num_labels)
    return METRICS[name](np.asarray(predictions), np.asarray(gold) if gold is not None else None, num_labels)
