"""Token tasks (`--problem tokens`): word-level BIO tags. A text is split into words on whitespace and tokenized as
its words joined by single spaces (aot.serving.words, the rule every served step follows); each word's tag is carried
by its first token, the others are ignored by the loss (label -100). Scored by entity-level F1 (seqeval) on the
words, a word cut off by the max length counting as tagged O."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from aot.serving.answers import tokens_answer
from aot.serving.words import OUTSIDE, first_pieces, split_words
from aot.training.data.task import DataError, Example, TaskSpec
from aot.training.kinds.base import Encoded, Kind, run_model
from aot.training.metrics import compute_metric

IGNORED = -100  # the label of a token that carries no tag (cross_entropy's ignore_index)


def align(tokenizer, text: str, max_length: int) -> tuple[list[int], list[int] | None, object, np.ndarray]:
    """A text's token ids (and token types), its words and, per token, the word it starts or -1: the alignment
    training and `aot predict` use, equal to the served one (aot.serving.tokenization.Tokenization.encode_words)."""
    words = split_words(text)
    enc = tokenizer(words.joined, truncation=True, max_length=max_length, return_offsets_mapping=True,
                    return_special_tokens_mask=True)
    return enc["input_ids"], enc.get("token_type_ids"), words, first_pieces(enc["offset_mapping"],
                                                                            enc["special_tokens_mask"], words)


class TokensKind(Kind):
    name = "tokens"

    def encode(self, tokenizer, examples: list[Example], spec: TaskSpec, max_length: int) -> Encoded:
        if not getattr(tokenizer, "is_fast", False):
            raise DataError("token tasks need a fast tokenizer (character offsets): this model's is not")
        ids, types, all_words, firsts = [], [], [], []
        for ex in examples:
            row_ids, row_types, words, first = align(tokenizer, ex.text, max_length)
            ids.append(row_ids)
            types.append(row_types)
            all_words.append(words)
            firsts.append(first)
        labelled = all(ex.label is not None for ex in examples)
        labels = gold = None
        if labelled:
            index = {tag: k for k, tag in enumerate(spec.labels)}
            gold = [tuple(ex.label) for ex in examples]
            labels = [[IGNORED if w < 0 else index[tags[w]] for w in first]
                      for first, tags in zip(firsts, gold, strict=True)]
        return Encoded(ids, None if types[0] is None else types, labels, words=all_words, first=firsts, gold=gold)

    def loss_from(self, outputs, inputs, encoded: Encoded, rows, spec: TaskSpec) -> torch.Tensor:
        logits = outputs[0]
        targets = torch.full(inputs[0]["input_ids"].shape, IGNORED, dtype=torch.long)
        for k, i in enumerate(rows):
            targets[k, : len(encoded.labels[i])] = torch.tensor(encoded.labels[i])
        return self.criterion(logits, targets.to(logits.device))

    def criterion(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy per token; a token without a tag (IGNORED) counts nothing."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORED)

    def predict(self, model, encoded: Encoded, pad_id, device) -> list[torch.Tensor]:
        """[S, n] logits per text."""
        return run_model(model, encoded, pad_id, device)

    def word_tags(self, spec: TaskSpec, predictions: list[torch.Tensor], encoded: Encoded) -> list[list[str]]:
        """Each text's tag per word: the arg-max at its first token, O for a word with none."""
        out = []
        for logits, first, words in zip(predictions, encoded.first, encoded.words, strict=True):
            tags = [OUTSIDE] * len(words.spans)
            starts = np.flatnonzero(first >= 0)
            for word, k in zip(first[starts], logits[starts].argmax(-1).tolist(), strict=True):
                tags[word] = spec.labels[k]
            out.append(tags)
        return out

    def score(self, predictions, encoded: Encoded, spec: TaskSpec) -> float:
        return compute_metric(spec.metric, self.word_tags(spec, predictions, encoded), encoded.gold,
                              spec.num_outputs)

    def answers(self, spec: TaskSpec, predictions, encoded: Encoded) -> list[dict]:
        return [tokens_answer(spec.labels, words, first, logits.numpy())
                for logits, words, first in zip(predictions, encoded.words, encoded.first, strict=True)]
