"""AoT P-Tuning in PEFT's shape: `get_aot_model(model, AotConfig(...))` wraps a transformers encoder, the result
trains in any loop (transformers.Trainer, accelerate, plain PyTorch) and `save_pretrained` writes the task artifact
that `aot export task` and `aot predict` read. `aot train` builds its AoT tasks with the same code
(aot.training.factory.build_task_model -> aot_task_model), so both write the same artifact.

PEFT cannot register a method from an outside package, so this mirrors its API rather than plugging into it
(docs/python-api.md maps one to the other). The package's __init__ does not import this module: it needs
aot.training.artifact, which imports the method registry (aot.training.methods), so that would be a circle;
aot.training.factory and the `aot` API import it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from aot.serving.kinds import KINDS, NONE, kind_spec
from aot.serving.protocol import pooling_row
from aot.training.artifact import ArtifactError, backbone_identity, read_task, restore, save_task, task_backbone
from aot.training.backbone import Backbone, BackboneError, architecture_for, declared_pooling, load_backbone
from aot.training.data.task import TaskSpec
from aot.training.kinds import kind_for
from aot.training.method_registry import MethodConfig, MethodError, method_spec
from aot.training.methods.aot_ptuning.config import AotConfig
from aot.training.methods.aot_ptuning.model import AotBody
from aot.training.model import (
    HEAD_ACTIVATIONS,
    ClassificationHead,
    TaskModel,
    TokenHead,
    embedding_loss,
    init_head_from_pooler,
    make_head,
)

DEFAULT_MAX_LENGTH = 128  # AotConfig.max_length None: this, or the encoder's limit if lower


class AotModel(TaskModel):
    """A frozen encoder with AoT's per-token biases (the body) and the trainable head of its task's kind.

    forward takes what a transformers classifier of sequences (or tokens) takes and returns its output, the loss
    computed when `labels` are given (its kind's criterion, aot.training.kinds: cross-entropy, mean squared error for one output,
    binary cross-entropy for multilabel, token labels -100 ignored). An embedding task returns `embeddings` and,
    given the positives (`pair_input_ids`, ...), the loss of the pairs (aot.training.model.embedding_loss; `labels`:
    their scores in [0, 1], or none for in-batch negatives). Only the AoT factors and the head train. Untrained, it
    computes exactly what the frozen model computes: P starts at zero.
    """

    def __init__(self, body: AotBody, head: nn.Module, config: AotConfig, method: MethodConfig,
                 spec: TaskSpec, identity: dict | None = None):
        super().__init__(body, head, config.pooling, spec.kind)
        self.aot_config, self.method, self.spec = config, method, spec
        self._identity = identity  # the backbone record save_pretrained writes; found on first save when None

    @property
    def base_model(self) -> nn.Module:
        """The frozen encoder (PEFT's base_model), with AoT's hooks in its layers."""
        return self.body.biased.encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                pair_input_ids: torch.Tensor | None = None, pair_attention_mask: torch.Tensor | None = None,
                pair_token_type_ids: torch.Tensor | None = None):
        from transformers.modeling_outputs import SequenceClassifierOutput, TokenClassifierOutput  # seconds

        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self.logits(input_ids, attention_mask, token_type_ids)
        if kind_spec(self.kind).pair_examples:
            pair = loss = None
            if pair_input_ids is not None:
                mask = torch.ones_like(pair_input_ids) if pair_attention_mask is None else pair_attention_mask
                pair = self.logits(pair_input_ids, mask, pair_token_type_ids)
                loss = embedding_loss(logits, pair, None if labels is None else labels.to(logits.device))
            return _embedding_output()(loss=loss, embeddings=logits, pair_embeddings=pair)
        loss = None if labels is None else kind_for(self.spec).criterion(logits, labels.to(logits.device))
        output = TokenClassifierOutput if kind_spec(self.kind).reads_tokens else SequenceClassifierOutput
        return output(loss=loss, logits=logits)

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameter counts, as PEFT's method of the same name."""
        params = list(self.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}")

    def fused_rows(self, chunk: int = 4096) -> torch.Tensor:
        """P for the whole vocabulary, [V, L, d] fp32 on the CPU, as the model computes it in eval mode."""
        vocab = int(self.body.embeddings.shape[0])
        with torch.no_grad():
            device = self.body.embeddings.device
            was_training = self.body.training
            self.body.eval()
            try:
                return torch.cat([self.body.rows(torch.arange(s, min(s + chunk, vocab), device=device)).float().cpu()
                                  for s in range(0, vocab, chunk)])
            finally:
                self.body.train(was_training)

    def backbone_record(self) -> dict:
        """The backbone identity the artifact records: the one `aot train` loaded, or, for a model from
        get_aot_model, its base model's, loaded from local files and checked to hold this encoder's frozen weights
        (the task will run on that backbone, so the record must not lie)."""
        if self._identity is None:
            self._identity = _checked_identity(self.base_model, self.aot_config.base_model_name_or_path)
        return self._identity

    def save_pretrained(self, save_directory: str | os.PathLike, metrics: dict | None = None,
                        training: dict | None = None) -> Path:
        """Write the task artifact (config.json, weights.safetensors with the trainable tensors only,
        metrics.json) atomically; `metrics` and `training` are recorded as given."""
        return save_task(save_directory, self, self.backbone_record(), self.method, self.spec,
                         self.aot_config.max_length, training or {"trainer": "external"}, metrics or {})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, base_model: str | None = None) -> "AotModel":
        """Load a task artifact (saved here or by `aot train`) on the backbone it records, or on `base_model`
        (a folder, 'minilm' or a hub id) if that moved; in eval mode, on the CPU."""
        backbone = load_backbone(base_model) if base_model else None
        artifact = read_task(path)
        method = artifact.method_config
        if not method_spec(method.method).shared_backbone:
            raise ArtifactError(f"task {path} was trained with method {method.method!r}; "
                                f"AotModel loads AoT tasks (fc, kron)")
        weights = artifact.weights()  # a damaged file is reported before the backbone is loaded
        backbone = task_backbone(artifact, backbone)
        model = aot_task_model(backbone, method, artifact.spec, artifact.pooling, artifact.max_length, artifact.head)
        return restore(artifact, model, weights)


def _checked_identity(encoder: nn.Module, name: str | None) -> dict:
    if not name:
        raise ArtifactError("save_pretrained: the model records no base model (built from a config, not loaded "
                            "from a folder): set AotConfig(base_model_name_or_path=FOLDER), the folder its encoder "
                            "and tokenizer were saved to")
    try:
        backbone = load_backbone(name, local_only=True)
    except (OSError, BackboneError) as exc:
        raise ArtifactError(f"save_pretrained: base model {name!r} is not available locally ({exc}); set "
                            f"AotConfig(base_model_name_or_path=FOLDER) to the folder of the encoder and "
                            f"tokenizer") from None
    ours = encoder.state_dict()
    for key, value in backbone.encoder.state_dict().items():
        if key.startswith("pooler."):  # not part of the AoT path: pool_states reads the final states
            continue
        mine = ours.get(key)
        if mine is None or mine.shape != value.shape or not torch.equal(mine.detach().cpu(), value):
            raise ArtifactError(f"save_pretrained: the encoder's weight {key!r} differs from base model {name!r}: "
                                f"AoT tasks run on the unmodified frozen encoder they were trained on")
    return backbone_identity(backbone)


# --- building --------------------------------------------------------------------------------------------------------

def get_aot_model(model: nn.Module, config: AotConfig) -> AotModel:
    """Wrap a transformers encoder of a supported family (BERT, RoBERTa, XLM-R, DeBERTa-v2) as an AoT task.

    `model`: an AutoModel (a new head of the task's kind, AotConfig.problem: a classification head on the pooled
    state, its dense layer started from BERT's pooler; a token head; or, for an embedding, none), an
    AutoModelForSequenceClassification or an AutoModelForTokenClassification (its own head, copied into the served
    head format and trained, as PEFT's modules_to_save trains it). The encoder is frozen in place (requires_grad
    False) and shared, not copied. Bad input raises one ValueError line naming the value.
    """
    from transformers import PreTrainedModel  # on first use: transformers takes seconds to import

    if not isinstance(model, PreTrainedModel):
        raise MethodError(f"get_aot_model takes a transformers model (AutoModel, AutoModelForSequenceClassification "
                          f"or AutoModelForTokenClassification), got {type(model).__name__}")
    architecture_for(model.config)
    encoder = model.base_model
    own_head = encoder is not model
    name_of = type(model).__name__
    if own_head and not name_of.endswith(("ForSequenceClassification", "ForTokenClassification")):
        raise MethodError(f"get_aot_model takes an AutoModel, AutoModelForSequenceClassification or "
                          f"AutoModelForTokenClassification, got {name_of}")
    problem = config.problem or _model_problem(model, own_head, config.num_labels)
    name = config.base_model_name_or_path or getattr(model, "name_or_path", "") or None
    if own_head:
        _check_own_head(model, config, problem)
        pooling = "cls"
    else:
        local = name is not None and os.path.isdir(name)
        pooling = config.pooling or (declared_pooling(name) if local else "cls")
    num_labels = config.num_labels or (len(config.labels) if config.labels and not own_head else 0) \
        or model.config.num_labels
    labels = config.labels
    if labels is None and kind_spec(problem).labelled:
        id2label = getattr(model.config, "id2label", None) or {}
        labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(num_labels)]
    config = dataclasses.replace(config, problem=problem, pooling=pooling, num_labels=num_labels,
                                 labels=None if labels is None else list(labels), base_model_name_or_path=name)
    spec = _spec(config)
    backbone = Backbone(name or "", encoder, None, "")
    make = (lambda: _own_head(model)) if own_head else (lambda: _new_head(backbone, spec))
    return _wrap(backbone, config, spec, make)


def _model_problem(model: nn.Module, own_head: bool, num_labels: int | None) -> str:
    """The kind a model says its task is (AotConfig.problem None)."""
    if type(model).__name__.endswith("ForTokenClassification"):
        return "tokens"
    if own_head and getattr(model.config, "problem_type", None) == "multi_label_classification":
        return "multilabel"
    return "regression" if (num_labels or model.config.num_labels) == 1 else "classification"


def _check_own_head(model: nn.Module, config: AotConfig, problem: str) -> None:
    """A classifier's own head serves its own kind: a token classifier's tokens, a sequence classifier's a pooled
    classification (single- or multi-label, or a score) on the first token."""
    tokens = type(model).__name__.endswith("ForTokenClassification")
    if kind_spec(problem).reads_tokens != tokens or kind_spec(problem).head == NONE:
        raise MethodError(f"AotConfig: problem={problem!r}, but {type(model).__name__}'s own head "
                          + ("tags tokens: use problem='tokens'" if tokens else
                             "reads one pooled state: an embedding or token task starts from an AutoModel"))
    if config.pooling not in (None, "cls"):
        raise MethodError(f"AotConfig: pooling={config.pooling!r}, but {type(model).__name__}'s own head reads "
                          f"the first token: leave pooling unset (or 'cls')")
    if config.num_labels not in (None, model.config.num_labels):
        raise MethodError(f"AotConfig: num_labels={config.num_labels}, but the model's head has "
                          f"{model.config.num_labels} outputs")


def _spec(config: AotConfig) -> TaskSpec:
    kind, spec = config.problem, kind_spec(config.problem)
    metric = config.metric or spec.metrics[0]
    if config.text_pairs and not spec.text_pairs:
        *most, last = [name for name, other in KINDS.items() if other.text_pairs]
        why = " (its pairs are its training examples; it answers one text)" if spec.pair_examples else ""
        raise MethodError(f"AotConfig: text_pairs applies to {', '.join(most)} and {last} tasks, not {kind}{why}")
    if spec.head == NONE:
        return TaskSpec(config.task_name, None, metric, kind=kind, normalize=config.normalize)
    if config.num_labels < 1:
        raise MethodError(f"AotConfig: num_labels must be at least 1 (1: regression), got {config.num_labels}")
    if not spec.labelled:
        if config.labels or config.num_labels != 1:
            raise MethodError(f"AotConfig: a regression head has one output and no labels (num_labels "
                              f"{config.num_labels}, labels {config.labels!r})")
        return TaskSpec(config.task_name, None, metric, config.text_pairs, kind=kind)
    if len(config.labels) != config.num_labels:
        raise MethodError(f"AotConfig: {len(config.labels)} labels {config.labels!r} for a head with "
                          f"{config.num_labels} outputs")
    return TaskSpec(config.task_name, tuple(config.labels), metric, config.text_pairs, kind=kind,
                    threshold=config.threshold if "threshold" in spec.record else None)


def _wrap(backbone: Backbone, config: AotConfig, spec: TaskSpec, new_head: Callable[[], nn.Module],
          identity: dict | None = None) -> AotModel:
    """The one constructor of AoT task models (get_aot_model and aot train): body first, then the head, so the
    random init depends on the seed alone."""
    pooling_row(config.pooling)
    limit = backbone.max_positions
    if config.max_length is None:
        config = dataclasses.replace(config, max_length=min(DEFAULT_MAX_LENGTH, limit or DEFAULT_MAX_LENGTH))
    if config.max_length < 1 or (limit is not None and config.max_length > limit):
        raise MethodError(f"AotConfig: max_length {config.max_length} is outside what the encoder accepts "
                          f"(1 to {limit} tokens)")
    method = config.method_config(int(backbone.embeddings.shape[0]))
    backbone.encoder.requires_grad_(False)
    body = method_spec(method.method).build(backbone, method)
    model = AotModel(body, new_head(), config, method, spec, identity)
    return model.to(backbone.embeddings.device)


def _new_head(backbone: Backbone, spec: TaskSpec, activation: str = "tanh",
              inner_size: int | None = None) -> nn.Module:
    head = make_head(spec, backbone.hidden_size, activation, inner_size)
    init_head_from_pooler(head, backbone.encoder)
    return head


def _own_head(model: nn.Module) -> nn.Module:
    """The classifier's head as a ClassificationHead (a sequence classifier) or a TokenHead (a token classifier)
    that computes exactly what it computes (in eval mode; its dropouts where the family has them)."""
    if type(model).__name__.endswith("ForTokenClassification"):  # every family: dropout, then classifier
        head = TokenHead(model.classifier.in_features, model.classifier.out_features, model.dropout.p)
        with torch.no_grad():
            head.out.weight.copy_(model.classifier.weight)
            head.out.bias.copy_(model.classifier.bias)
        return head
    kind = model.config.model_type
    if kind == "bert":  # pooler (dense, tanh) then dropout, classifier
        dense, out, activation = model.bert.pooler.dense, model.classifier, "tanh"
        dropout, input_dropout = model.dropout.p, 0.0
    elif kind in ("roberta", "xlm-roberta"):  # dropout, dense, tanh, dropout, out_proj
        dense, out, activation = model.classifier.dense, model.classifier.out_proj, "tanh"
        dropout = input_dropout = model.classifier.dropout.p
    elif kind == "deberta-v2":  # ContextPooler (dropout, dense, pooler_hidden_act), dropout, classifier
        dense, out, activation = model.pooler.dense, model.classifier, model.config.pooler_hidden_act
        dropout, input_dropout = model.dropout.p, model.pooler.dropout.p
    else:  # pragma: no cover - architecture_for admits only the families above
        raise MethodError(f"no head mapping for model_type {kind!r}")
    if activation not in HEAD_ACTIVATIONS:
        raise MethodError(f"{type(model).__name__}: head activation {activation!r} is not served: expected one of "
                          f"{', '.join(HEAD_ACTIVATIONS)}")
    head = ClassificationHead(dense.in_features, out.out_features, dropout, activation, input_dropout,
                              dense.out_features)
    with torch.no_grad():
        for mine, theirs in ((head.dense, dense), (head.out, out)):
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
    return head


def aot_task_model(backbone: Backbone, method: MethodConfig, spec: TaskSpec, pooling: str, max_length: int | None,
                   head: dict | None = None) -> AotModel:
    """An AoT task on a loaded backbone (`aot train`, loading an artifact): the same constructor as get_aot_model.
    `head`: the artifact's head record ({"activation", "inner_size"} of a classification head), None for a new
    head (tanh)."""
    config = AotConfig.from_method(method, problem=spec.kind, pooling=pooling, num_labels=spec.num_outputs,
                                   labels=None if spec.labels is None else list(spec.labels), metric=spec.metric,
                                   threshold=spec.threshold, normalize=spec.normalize, text_pairs=spec.has_pair,
                                   task_name=spec.name,
                                   max_length=max_length, base_model_name_or_path=backbone.name)
    head = head or {}
    activation, inner = head.get("activation", "tanh"), head.get("inner_size")
    return _wrap(backbone, config, spec, lambda: _new_head(backbone, spec, activation, inner),
                 backbone_identity(backbone) if backbone.fingerprint else None)


@functools.cache
def _embedding_output():
    """The output of an embedding task's forward: a transformers ModelOutput (defined on first use: transformers
    takes seconds to import)."""
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class EmbeddingOutput(ModelOutput):
        loss: torch.Tensor | None = None
        embeddings: torch.Tensor | None = None
        pair_embeddings: torch.Tensor | None = None

    return EmbeddingOutput
