"""Batches of pairs for an embedding task trained in your own loop (transformers.Trainer's `data_collator`): each
row holds the anchor's tokenizer output and the positive's under `pair_` names (pair_input_ids, ...), and
optionally a `labels` score; both sides are padded, each to its own longest, as AotModel.forward takes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAIR_PREFIX = "pair_"


@dataclass
class PairCollator:
    """`tokenizer`: the encoder's (its pad token pads both sides)."""

    tokenizer: object

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        anchors = [{k: v for k, v in r.items() if not k.startswith(PAIR_PREFIX) and k != "labels"} for r in rows]
        positives = [{k[len(PAIR_PREFIX):]: v for k, v in r.items() if k.startswith(PAIR_PREFIX)} for r in rows]
        batch = dict(self.tokenizer.pad(anchors, return_tensors="pt"))
        batch |= {PAIR_PREFIX + k: v for k, v in self.tokenizer.pad(positives, return_tensors="pt").items()}
        if all("labels" in r for r in rows):
            batch["labels"] = torch.tensor([float(r["labels"]) for r in rows])
        return batch
