"""Words of a token task's text: where each word is, which token starts it, and the entities its tags spell.

A token task is trained on word-level BIO tags and answers with entities at character offsets into the caller's
text. Training, `aot predict` and every served step split a text into words here (runs of non-whitespace, as the
data's tokens were: a word never holds whitespace), tokenize the words joined by single spaces, and give each word
the prediction of its first token: one rule, so a served answer equals the PyTorch one.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_WORD = re.compile(r"\S+")
OUTSIDE = "O"  # the tag of a word in no entity


@dataclass(frozen=True)
class Words:
    """A text's words: `spans[k]` is word k's [start, end) in `text`, in characters (str indices)."""

    text: str
    spans: tuple[tuple[int, int], ...]

    @property
    def joined(self) -> str:
        """The words joined by single spaces: what the tokenizer reads (the caller's spacing never changes a token)."""
        return " ".join(self.text[s:e] for s, e in self.spans)

    def joined_ends(self) -> list[int]:
        """Each word's end in `joined`."""
        ends, at = [], 0
        for s, e in self.spans:
            at += e - s
            ends.append(at)
            at += 1
        return ends


def split_words(text: str) -> Words:
    return Words(text, tuple(m.span() for m in _WORD.finditer(text)))


def first_pieces(offsets: Sequence[tuple[int, int]], special: Sequence[int], words: Words) -> np.ndarray:
    """For each token of `words.joined` (its character offsets and special-token mask, as the tokenizer reports
    them), the word it starts, or -1: special tokens, and every piece of a word but its first. A token belongs to
    the first word that ends after its start (a token that starts on a space belongs to the word after it)."""
    ends = words.joined_ends()
    out = np.full(len(offsets), -1, dtype=np.int32)
    seen = -1
    for k, ((start, _), is_special) in enumerate(zip(offsets, special, strict=True)):
        if is_special:
            continue
        word = bisect.bisect_right(ends, start)
        if word < len(ends) and word > seen:
            out[k] = seen = word
    return out


def check_tag(tag: str) -> str:
    """A BIO tag: `O`, `B-<type>` or `I-<type>`; ValueError otherwise."""
    if tag == OUTSIDE or (len(tag) > 2 and tag[:2] in ("B-", "I-")):
        return tag
    raise ValueError(f"tag {tag!r} is not a BIO tag: expected O, B-<type> or I-<type>")


def entity_spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """(type, first word, last word) of each entity of a BIO sequence: seqeval's rule (its default, lenient mode):
    an entity starts at B-, or at an I- that does not continue an entity of its type, and ends before the next
    word that does not continue it."""
    spans, start, prev_type = [], 0, None
    for i, tag in enumerate([*tags, OUTSIDE]):
        kind = tag[2:] if tag != OUTSIDE else None
        if prev_type is not None and (kind != prev_type or tag[0] == "B"):
            spans.append((prev_type, start, i - 1))
            prev_type = None
        if kind is not None and prev_type is None:
            start, prev_type = i, kind
    return spans


def entities(words: Words, tags: Sequence[str], scores: Sequence[float]) -> list[dict]:
    """The answer's entities: `tags` and `scores` (the probability of each word's tag) per word of `words`; each
    entity's text and [start, end) in the caller's text, and the mean score of its words."""
    out = []
    for kind, first, last in entity_spans(tags):
        start, end = words.spans[first][0], words.spans[last][1]
        out.append({"text": words.text[start:end], "label": kind, "start": start, "end": end,
                    "score": float(np.mean(scores[first:last + 1]))})
    return out
