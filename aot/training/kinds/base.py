"""What every kind shares: a split as token ids, batches of them, the loop that runs a model over a split, and the
interface each kind implements (aot.training.kinds: pooled, tokens, embedding)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aot.serving.words import Words
from aot.training.data.task import Example, TaskSpec


@dataclass
class Encoded:
    """A split as token ids (unpadded) and what its kind trains towards.

    `labels`: the kind's targets (None: unlabelled texts to predict). `pair`: an embedding task's positives, row
    for row. `words`, `first`: a token task's words of each text and, per token, the word it starts or -1
    (aot.serving.words.first_pieces); `gold`: its tags per word."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None
    labels: object = None
    pair: Encoded | None = None
    words: list[Words] | None = None
    first: list[np.ndarray] | None = None
    gold: list[tuple[str, ...]] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def collate(encoded: Encoded, rows, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The token tensors of `rows`, right-padded to the longest."""
    length = max(len(encoded.input_ids[i]) for i in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    types = torch.zeros((len(rows), length), dtype=torch.long)
    for k, i in enumerate(rows):
        seq = encoded.input_ids[i]
        ids[k, : len(seq)] = torch.tensor(seq)
        mask[k, : len(seq)] = 1
        if encoded.token_type_ids is not None:
            types[k, : len(seq)] = torch.tensor(encoded.token_type_ids[i])
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return {k: v.to(device) for k, v in batch.items()}


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def run_model(model, encoded: Encoded, pad_id: int, device: torch.device, batch_size: int = 64) -> list[torch.Tensor]:
    """The model's output for every row, on the CPU in fp32, in the split's order: [n] or [d] per row, or [S, n]
    per row (a token task's, its own length). Rows of similar length share a batch."""
    model.eval()
    order = sorted(range(len(encoded)), key=lambda i: len(encoded.input_ids[i]))
    out: list[torch.Tensor | None] = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        with autocast(device):
            logits = model.logits(**collate(encoded, rows, pad_id, device))
        logits = logits.float().cpu()
        for k, i in enumerate(rows):
            out[i] = logits[k, : len(encoded.input_ids[i])] if logits.dim() == 3 else logits[k]
    return out  # type: ignore[return-value]


class Kind:
    """How a task of one kind trains, predicts and is scored. `predictions` are what `predict` returns."""

    name: str  # its spec's in the registry of kinds (aot.serving.kinds.KINDS)
    tunes = False  # whether calibrate tunes something on dev after training

    def encode(self, tokenizer, examples: list[Example], spec: TaskSpec, max_length: int) -> Encoded:
        raise NotImplementedError

    def loss(self, model, encoded: Encoded, rows: list[int], pad_id: int, device: torch.device,
             spec: TaskSpec) -> torch.Tensor:
        """The loss of the batch `rows`: the model's output on each of its inputs, then loss_from."""
        inputs = self.inputs(encoded, rows, pad_id, device)
        return self.loss_from([model.logits(**batch) for batch in inputs], inputs, encoded, rows, spec)

    def inputs(self, encoded: Encoded, rows: list[int], pad_id: int, device: torch.device) -> list[dict]:
        """The token tensors (collate) that a step on `rows` runs through the model, in order: the texts; an
        embedding task's anchors, then their positives. A job of many tasks runs them in passes shared with other
        tasks' (aot.training.mixed_step), then calls loss_from as `loss` does."""
        return [collate(encoded, rows, pad_id, device)]

    def loss_from(self, outputs: list[torch.Tensor], inputs: list[dict], encoded: Encoded, rows: list[int],
                  spec: TaskSpec) -> torch.Tensor:
        """The loss of the batch `rows` from the model's `outputs` on its `inputs` (one output per input)."""
        raise NotImplementedError

    def criterion(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of a head's outputs against its targets (what a transformers-style forward with `labels`
        computes, aot.training.methods.aot_ptuning.peft_model); an embedding's pairs have their own (loss_from)."""
        raise NotImplementedError

    def predict(self, model, encoded: Encoded, pad_id: int, device: torch.device):
        raise NotImplementedError

    def score(self, predictions, encoded: Encoded, spec: TaskSpec) -> float:
        raise NotImplementedError

    def calibrate(self, predictions, encoded: Encoded, spec: TaskSpec) -> TaskSpec:
        """The spec with what is tuned on dev after training (a multi-label threshold); most kinds tune nothing."""
        return spec

    def answers(self, spec: TaskSpec, predictions, encoded: Encoded) -> list[dict]:
        """One answer per row (aot.serving.answers), without the task's name."""
        raise NotImplementedError
