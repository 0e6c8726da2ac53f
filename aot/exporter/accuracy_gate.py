"""No task silently loses accuracy on an int8 backbone: before a task is published into a repository whose CPU
configs run int8 graphs, its own dev examples are scored through the int8 engine (aot.exporter.cpu_engine, as served)
and compared with its fp32 score on the same examples, with the task's own metric whatever its kind (the artifact
names it): a classifier's on its served logits, a tagger's entity F1 on the tags its served logits give each word,
an embedding's recall or correlation on the vectors served for its anchors and positives. More than `allowed_drop`
points below (0.5 by default) is refused with both figures and the ways out. What was measured is recorded in the
version's task.json (`served_dev`), which `aot tasks` and `aot export list` show.

A gate means something only on enough examples: with n of them one flipped example moves a score 100 / n points (17 on
6 examples, against a default allowance of 0.5). Fewer than MIN_DEV_EXAMPLES are refused unless the operator accepts
the sample (`aot export task --allow-small-dev-sample`, recorded as `small_sample_accepted`); fewer than
FEW_DEV_EXAMPLES pass with a warning that says how far one example moves the score."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from aot.exporter.cpu_engine import CpuEngine
from aot.serving.heads import Answer
from aot.serving.repository import RepositoryInfo
from aot.serving.store.layout import TASK_JSON
from aot.serving.store.reader import StoreError
from aot.serving.store.writer import TaskStore
from aot.serving.tasks import ServedTask, load_task_version
from aot.training.data import recorded_task_data
from aot.training.data.task import DataError, Example
from aot.training.evaluate import read_labelled_file
from aot.training.kinds import Encoded
from aot.training.predict import Predictor
from aot.training.trainer import encode, evaluate, score

DEFAULT_ALLOWED_DROP = 0.5  # points (the metric x 100)
MIN_DEV_EXAMPLES = 50  # below: refused unless accepted (one example moves a score 2 points or more)
FEW_DEV_EXAMPLES = 300  # below: a warning (one example moves a score a third of a point or more)


class AccuracyDropError(StoreError):
    """A task that would serve more than the allowed drop below its fp32 score; nothing was published."""


class SmallSampleError(StoreError):
    """Too few dev examples for the gate to tell a drop from one flipped example; nothing was published."""


class SmallSampleWarning(UserWarning):
    """A gate passed on few dev examples (`aot` prints it as `aot: warning: ...`)."""


def check_sample(task: str, examples: int, allowed: float, accept_small: bool) -> None:
    """Refuse fewer than MIN_DEV_EXAMPLES dev examples unless `accept_small`; warn under FEW_DEV_EXAMPLES."""
    if examples >= FEW_DEV_EXAMPLES:
        return
    flip = 100 / max(examples, 1)
    said = (f"task {task!r}: the int8 gate scores {examples} dev example(s): one flipped example moves its score "
            f"{flip:.2g} points (allowed drop: {allowed:g})")
    if examples < MIN_DEV_EXAMPLES and not accept_small:
        raise SmallSampleError(f"{said}, fewer than {MIN_DEV_EXAMPLES}: the gate cannot tell a drop from noise; "
                               "nothing was published. Give --dev-data FILE with more examples, or accept this "
                               "sample with --allow-small-dev-sample (recorded in the version's served_dev)")
    warnings.warn(f"{said}; {FEW_DEV_EXAMPLES} or more make the gate meaningful (--dev-data FILE)"
                  + (" (accepted: --allow-small-dev-sample)" if examples < MIN_DEV_EXAMPLES else ""),
                  SmallSampleWarning, stacklevel=3)


@dataclass
class ServedScore:
    """A task version's dev score as served (`served_dev` in task.json)."""

    precision: str
    metric: str
    score: float  # through the served engine
    fp32: float  # the fp32 reference: the task's own (PyTorch) score on the same examples, or, for a re-fitted task,
    # the score of the fp32 task it was fitted from
    examples: int
    allowed_drop: float  # points
    reference: str  # "fp32 task" or "fitted from <dir>"
    graph: str  # sha256 of the int8 graph that scored it: a re-export keeps the task only onto the same graph
    small_sample_accepted: bool = False  # fewer than MIN_DEV_EXAMPLES, published with --allow-small-dev-sample

    @property
    def drop(self) -> float:
        """Points below the fp32 reference (negative: above it)."""
        return (self.fp32 - self.score) * 100

    def to_json(self) -> dict:
        return {**asdict(self), "drop": round(self.drop, 4)}


def dev_examples(predictor: Predictor, dev_data: str | Path | None) -> list[Example]:
    """The task's dev examples: `dev_data` (a file with the training columns of the task's kind, read as a split
    file of that kind is) when given, else the dev split of the data the artifact records it was trained on."""
    spec = predictor.artifact.spec
    if dev_data is not None:
        return read_labelled_file(dev_data, spec)
    source = predictor.artifact.config.get("training", {}).get("data")
    if not source:
        raise StoreError(f"task {predictor.artifact.path} records no training data to score its dev examples: "
                         "pass --dev-data FILE (the training columns of its kind)")
    try:
        data = recorded_task_data(source, spec)
    except (DataError, OSError) as exc:
        raise StoreError(f"cannot read the dev examples of task {predictor.artifact.path} from its training data "
                         f"{source!r}: {exc}; pass --dev-data FILE (the training columns of its kind)") from None
    if not data.dev:
        raise StoreError(f"the training data {source!r} of task {predictor.artifact.path} has no dev examples: pass "
                         "--dev-data FILE")
    return data.dev


def fp32_reference(predictor: Predictor, scored: float) -> tuple[float, str]:
    """What the served score is held against: the fp32 task this one was re-fitted from (its score, recorded by
    `aot train --fit-to`), else this task's own fp32 score on the same examples."""
    fitted = predictor.artifact.config.get("training", {}).get("fit_to")
    if fitted and fitted.get("fp32_dev") is not None:
        return float(fitted["fp32_dev"]), f"fitted from {fitted.get('task')}"
    return scored, "fp32 task"


def _word_logits(answer: Answer, first: np.ndarray, labels: int) -> torch.Tensor:
    """A tagger's served logits (each word's first token's, in order) placed at the tokens training aligned its
    words to, [S, n]; the other rows are never read by its score."""
    starts = first >= 0
    values = answer.values.reshape(-1, labels)
    if len(values) != int(starts.sum()):
        raise StoreError(f"the served tokenizer finds {len(values)} words' first tokens where training finds "
                         f"{int(starts.sum())}: the task cannot be scored as served")
    out = np.zeros((len(first), labels), np.float32)
    out[starts] = values
    return torch.from_numpy(out)


def served_predictions(engine: CpuEngine, task: ServedTask, examples: list[Example], encoded: Encoded):
    """What the served step answers to the dev examples, in the form the task's kind scores (aot.training.kinds: its
    `predict`): a pooled kind's head outputs [N, n]; an embedding's vectors of the anchors and of their positives
    (each text alone, as a search embeds it; the positives None without pairs); a tagger's logits per text."""
    if task.spec.pair_examples:
        def vectors(texts: list[str]) -> torch.Tensor:
            return torch.from_numpy(np.stack([a.values for a in engine.answers(task, [(t, None) for t in texts])]))

        return (vectors([e.text for e in examples]),
                None if encoded.pair is None else vectors([e.text_pair for e in examples]))
    answers = engine.answers(task, [(e.text, e.text_pair) for e in examples])
    if task.spec.reads_tokens:
        return [_word_logits(a, first, len(task.labels)) for a, first in zip(answers, encoded.first, strict=True)]
    return torch.from_numpy(np.stack([a.values for a in answers]))


def check_served_accuracy(repo: RepositoryInfo, folder: Path, predictor: Predictor,
                          allowed_drop: float | None = None, dev_data: str | Path | None = None,
                          engine: CpuEngine | None = None, accept_small: bool = False) -> ServedScore | None:
    """For an int8 repository: score version `folder` (not yet published) on the task's dev examples through the
    int8 engine and against its fp32 reference; record the result in its task.json, or raise AccuracyDropError
    (SmallSampleError: too few examples, unless `accept_small`). An fp32 repository serves what the task scored
    (checked to 1e-3 on the logits at export): None. `engine`: the repository's CpuEngine, built once by a caller
    that checks many tasks."""
    if repo.record.cpu_precision == "fp32":
        return None
    allowed = DEFAULT_ALLOWED_DROP if allowed_drop is None else allowed_drop
    artifact, spec = predictor.artifact, predictor.artifact.spec
    examples = dev_examples(predictor, dev_data)
    check_sample(TaskStore.version_name(folder).rsplit("@", 1)[0], len(examples), allowed, accept_small)
    tokenizer = predictor.backbone.tokenizer
    encoded = encode(tokenizer, examples, spec, artifact.max_length)
    fp32 = evaluate(predictor.model, encoded, spec, tokenizer.pad_token_id or 0, predictor.device)
    served = load_task_version(folder, TaskStore.version_name(folder), repo.store_root)
    engine = engine or CpuEngine(repo)
    predictions = served_predictions(engine, served, examples, encoded)
    reference, origin = fp32_reference(predictor, fp32)
    result = ServedScore(repo.record.cpu_precision, spec.metric, score(predictions, encoded, spec), reference,
                         len(examples), allowed, origin, engine.graph_digest,
                         small_sample_accepted=len(examples) < MIN_DEV_EXAMPLES)
    if result.drop > allowed + 1e-9:
        raise AccuracyDropError(
            f"task {served.name!r}: dev {spec.metric} through the {result.precision} engine is "
            f"{result.score * 100:.2f}, {result.drop:.2f} points below its fp32 {result.fp32 * 100:.2f} "
            f"({origin}, {len(examples)} dev examples; allowed: {allowed:g}); nothing was published. Re-fit it to this "
            f"backbone (aot train --fit-to {repo.path} --task {artifact.path} --out DIR, then export DIR), or accept "
            f"the drop: --allow-accuracy-drop {math.ceil(round(result.drop, 6) * 100) / 100:g}")
    meta_path = folder / TASK_JSON
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta["served_dev"] = result.to_json()
    meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return result
