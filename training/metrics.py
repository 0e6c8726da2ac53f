"""The paper's task metrics (its Table 1), from scikit-learn and scipy.

Scores are fractions in [0, 1] (correlations in [-1, 1]); reports multiply by 100 like the paper.
F1 is binary F1 of the second label (GLUE's positive class, e.g. MRPC/QQP "1") for two labels, macro F1 otherwise
(as for CB).
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
}


def compute_metric(name: str, predictions: Sequence, gold: Sequence, num_labels: int) -> float:
    """`predictions`/`gold` are label indices for classification, floats for regression."""
    return METRICS[name](np.asarray(predictions), np.asarray(gold), num_labels)
