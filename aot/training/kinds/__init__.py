"""Per kind of task (aot.serving.answers.TASK_KINDS): how its examples become tensors, its loss, its predictions, their
score on dev and the answers `aot predict` prints (base.Kind).

    base        the Kind interface, Encoded examples and collate
    pooled      classification, regression and multi-label: a head on the pooled state
    tokens      token tagging (named entities, BIO tags)
    embedding   sentence embeddings trained on pairs
"""

from aot.training.data.task import TaskSpec
from aot.training.kinds.base import Encoded, Kind, collate
from aot.training.kinds.embedding import EmbeddingKind
from aot.training.kinds.pooled import PooledKind
from aot.training.kinds.tokens import TokensKind

KIND_OF: dict[str, Kind] = {kind.name: kind for kind in (
    PooledKind("classification"), PooledKind("regression"), PooledKind("multilabel"), TokensKind(), EmbeddingKind())}


def kind_for(spec: TaskSpec) -> Kind:
    return KIND_OF[spec.kind]


__all__ = ["Encoded", "KIND_OF", "Kind", "collate", "kind_for"]
