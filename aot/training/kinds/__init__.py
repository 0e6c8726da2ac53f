"""Training's part of each kind of task (its spec: aot.serving.kinds.KINDS): how its examples become tensors, its
loss, its predictions, their score on dev and the answers `aot predict` prints (base.Kind), attached to the registry
by the kind's name.

    base        the Kind interface, Encoded examples and collate
    pooled      classification, regression and multi-label: a head on the pooled state
    tokens      token tagging (named entities, BIO tags)
    embedding   sentence embeddings trained on pairs
"""

from aot.serving.kinds import KINDS
from aot.training.data.task import TaskSpec
from aot.training.kinds.base import Encoded, Kind, collate
from aot.training.kinds.embedding import EmbeddingKind
from aot.training.kinds.pooled import ClassificationKind, MultilabelKind, RegressionKind
from aot.training.kinds.tokens import TokensKind

KIND_OF: dict[str, Kind] = {}


def attach(kind: Kind) -> Kind:
    """Training's part of a registered kind."""
    if kind.name not in KINDS:
        raise ValueError(f"training kind {kind.name!r} has no spec: expected one of {', '.join(KINDS)}")
    KIND_OF[kind.name] = kind
    return kind


for _kind in (ClassificationKind(), RegressionKind(), MultilabelKind(), TokensKind(), EmbeddingKind()):
    attach(_kind)


def kind_for(spec: TaskSpec) -> Kind:
    return KIND_OF[spec.kind]


__all__ = ["Encoded", "KIND_OF", "Kind", "attach", "collate", "kind_for"]
