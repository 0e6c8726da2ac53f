"""Per kind of task (serving.answers.KINDS): how its examples become tensors, its loss, its predictions, their
score on dev and the answers `aot predict` prints (training.kinds.base.Kind)."""

from training.data.task import TaskSpec
from training.kinds.base import Encoded, Kind, collate
from training.kinds.embedding import EmbeddingKind
from training.kinds.pooled import PooledKind
from training.kinds.tokens import TokensKind

KIND_OF: dict[str, Kind] = {kind.name: kind for kind in (
    PooledKind("classification"), PooledKind("regression"), PooledKind("multilabel"), TokensKind(), EmbeddingKind())}


def kind_for(spec: TaskSpec) -> Kind:
    return KIND_OF[spec.kind]


__all__ = ["Encoded", "KIND_OF", "Kind", "collate", "kind_for"]
