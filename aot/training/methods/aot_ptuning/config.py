"""Hyperparameters of AoT P-Tuning (paper section 3.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

from aot.training.method_registry import MethodConfig, MethodError, make_config

ACTIVATIONS = ("tanh", "gelu", "relu", "identity")


@dataclass
class FCConfig(MethodConfig):
    """FC reparametrization: P^i = f(dropout(E) W1^i + b1^i) W2^i + b2^i, one MLP per layer.

    rank: width r of the MLP (paper grid: 32, 64, 128, 256, 512).
    activation: f. Default tanh: it keeps every feature of E W1 (order one by construction) in a bounded,
        zero-centred range, so P starts small and smooth and no unit is dead at init (ReLU drops half of them).
    dropout: applied to the embedding rows E before W1 (paper).
    """

    method: ClassVar[str] = "fc"
    rank_field: ClassVar[str] = "rank"
    rank: int = 64
    activation: str = "tanh"
    dropout: float = 0.1

    def validate(self) -> None:
        super().validate()
        if self.activation not in ACTIVATIONS:
            raise MethodError(f"fc: unknown activation {self.activation!r}: expected one of {', '.join(ACTIVATIONS)}")


@dataclass
class KronConfig(MethodConfig):
    """Kronecker reparametrization: P^i = (W_L^i ⊗ W_M^i) W_R^i; token x is row (x // b, x % b).

    rank: r (paper grid: 5, 10, 25, 30, 50); W_R is r^2 x d.
    a, b: factor sizes with a * b >= |V|; None picks the near-square pair (a = ceil(sqrt|V|), b = ceil(|V| / a)).
    dropout: applied to the looked-up rows P_x (paper: 0.1).
    """

    method: ClassVar[str] = "kron"
    rank_field: ClassVar[str] = "rank"
    rank: int = 10
    a: int | None = None
    b: int | None = None
    dropout: float = 0.1

    def resolve(self, vocab_size: int) -> "KronConfig":
        if self.a is None and self.b is None:
            self.a = math.isqrt(vocab_size - 1) + 1
            self.b = -(-vocab_size // self.a)
        elif self.a is None or self.b is None:
            given = self.a or self.b
            other = -(-vocab_size // given)
            self.a, self.b = (given, other) if self.a else (other, given)
        if self.a * self.b < vocab_size:
            raise MethodError(f"kron: a * b = {self.a} * {self.b} = {self.a * self.b} < vocabulary size {vocab_size}")
        return self


def _help(text: str, default=None):
    """A config field that carries its help text, as PEFT's config fields do (`dataclasses.fields(AotConfig)`)."""
    return field(default=default, metadata={"help": text})


@dataclass
class AotConfig:
    """What `aot.get_aot_model` needs: the method and its hyperparameters, and what the saved task records for
    serving. None everywhere means "the method's default" or "what the model says"; `aot train` builds one too."""

    method: str = _help("AoT reparametrization of P: 'fc' (an MLP over the embeddings) or 'kron' (Kronecker "
                        "factors)", "fc")
    rank: int | None = _help("fc: MLP width r; kron: factor rank r (None: the method's default, fc 64, kron 10)")
    activation: str | None = _help("fc only: the MLP's activation, tanh, gelu, relu or identity (None: tanh)")
    dropout: float | None = _help("dropout on the embedding rows (fc) or the looked-up rows (kron) while "
                                  "training (None: 0.1)")
    a: int | None = _help("kron only: rows of the left factor, a * b >= vocabulary size (None: near-square)")
    b: int | None = _help("kron only: rows of the middle factor (None: near-square)")
    pooling: str | None = _help("what a new head reads: 'cls' (first token) or 'mean' (None: 'cls', or what a "
                                "sentence-transformers folder declares). A sequence-classification model's own "
                                "head reads the first token, so only 'cls' applies to it")
    problem: str | None = _help("the task's kind (PEFT's task_type): classification, regression, multilabel, "
                                "tokens or embedding (None: what the model says: tokens for a token classifier, "
                                "multilabel for a sequence classifier of problem_type multi_label_classification, "
                                "regression for num_labels 1, else classification). An AutoModel takes any; "
                                "embedding is an AutoModel's only")
    num_labels: int | None = _help("outputs of a new head on an AutoModel; 1 is regression (None: as many as "
                                   "`labels`, else model.config.num_labels). A classifier of sequences or tokens "
                                   "keeps its own")
    labels: list[str] | None = _help("label names in output order (None: model.config.id2label); what serving "
                                     "answers with")
    metric: str | None = _help("the task's metric, recorded for reports: accuracy, f1, acc_f1, mcc or "
                               "pearson_spearman; micro_f1 or macro_f1 (multilabel); entity_f1 (tokens); recall@1, "
                               "recall@5, recall@10 or spearman (embedding) (None: the kind's first)")
    threshold: float | None = _help("multilabel: the sigmoid a label must reach to be answered (None: 0.5; aot "
                                    "train tunes it on dev)")
    normalize: bool = _help("embedding: answer unit vectors (the cosine is then a dot product)", True)
    text_pairs: bool = _help("trained on text pairs (premise and hypothesis, question and passage; classification, "
                             "regression or multilabel): the server and `aot predict` then answer a text with its "
                             "pair and refuse a single text, as a task trained on single texts refuses a pair", False)
    task_name: str = _help("the task's name in the saved artifact", "task")
    max_length: int | None = _help("tokens per input at serving time (longer inputs are truncated): use the "
                                   "length you train with (None: 128, or the encoder's limit if lower)")
    base_model_name_or_path: str | None = _help("the frozen encoder's folder, 'minilm' or hub id, recorded so "
                                                "that the task loads and exports on it (None: model.name_or_path)")

    def method_config(self, vocab_size: int | None = None) -> MethodConfig:
        """The method's own config (FCConfig, KronConfig), checked; MethodError names a bad value."""
        if self.method not in METHOD_OPTIONS:
            raise MethodError(f"AotConfig: unknown method {self.method!r}: expected one of "
                              f"{', '.join(METHOD_OPTIONS)}")
        options = {}
        for name in ("activation", "dropout", "a", "b"):
            value = getattr(self, name)
            if value is None:
                continue
            if name not in METHOD_OPTIONS[self.method]:
                raise MethodError(f"AotConfig: {name}={value!r} applies to "
                                  f"{' and '.join(m for m, o in METHOD_OPTIONS.items() if name in o)} only, "
                                  f"not method {self.method!r}")
            options[name] = value
        config = make_config(self.method, rank=self.rank, **options)
        if isinstance(config, KronConfig) and vocab_size is not None:
            config.resolve(vocab_size)
        return config

    @classmethod
    def from_method(cls, config: MethodConfig, **task) -> "AotConfig":
        """The AotConfig of a method config (`aot train`, a saved artifact) and the task fields in `task`."""
        data = config.to_json()
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in fields(cls)}}, **task)


METHOD_OPTIONS = {"fc": ("activation", "dropout"), "kron": ("a", "b", "dropout")}
