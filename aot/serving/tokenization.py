"""Text (+ pair) -> token ids, truncated to the task's max length exactly as in training and `aot predict`.

The exported tokenizer folder is what transformers' save_pretrained wrote; serving reads its `tokenizer.json`
with the `tokenizers` library (what transformers' fast tokenizers run underneath), so no transformers or torch is
imported by a served step. Truncation is transformers' `truncation=True`: longest_first, on the tokenizer's
truncation side; tests check the ids equal transformers' for every architecture.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

import numpy as np

from aot import settings
from aot.serving import protocol
from aot.serving.errors import RequestError
from aot.serving.formats import read_json
from aot.serving.words import Words, first_pieces, split_words


def is_blank(text: str) -> bool:
    """Nothing to read: only whitespace, control characters (NUL...) or invisible format characters (zero-width
    space, joiners, BOM). Such a text is refused like an empty one, by the server and by `aot predict` alike."""
    return all(unicodedata.category(ch)[0] in "CZ" for ch in text)


# what a blank text is answered (the server, and a client that tokenizes on its own side)
BLANK_TEXT = f"{protocol.TEXT} is empty (or only whitespace, control or zero-width characters)"


def given_pair(pair: str | None) -> str | None:
    """A request's second text as served: none when absent or blank (is_blank)."""
    return None if pair is None or is_blank(pair) else pair


def pair_mismatch(has_pair: bool | None, paired: bool) -> bool:
    """A pair sent to a task trained on single texts, or none sent to a pair task: refused by the server and by `aot
    predict` alike, as it would silently change the answer (`has_pair` None: a version exported before it was
    recorded accepts both)."""
    return has_pair is not None and has_pair != paired


# the most threads the default gives a GPU step's tokenizer: a host of many cores does not start one per core in
# every instance
MAX_DEFAULT_TOKENIZER_THREADS = 8


def tokenizer_threads(on_gpu: bool, instances: int, cores: int | None = None) -> int:
    """The threads a step's tokenizer encodes a batch on: AOT_TOKENIZER_THREADS, else on a GPU step the host's cores
    shared among the step's instances (its CPU cores are otherwise idle while the GPU runs the encoder), at most
    MAX_DEFAULT_TOKENIZER_THREADS; on a CPU step 1 (its cores run the engine)."""
    chosen = settings.TOKENIZER_THREADS.read()
    if chosen is not None:
        return chosen
    if not on_gpu:
        return 1
    return max(1, min(MAX_DEFAULT_TOKENIZER_THREADS, (cores or os.cpu_count() or 1) // max(1, instances)))


def use_tokenizer_threads(threads: int) -> None:
    """Let the Rust tokenizer encode a batch on `threads` threads, 1 keeping it on the calling one. Read by the
    tokenizers library at every batch (TOKENIZERS_PARALLELISM) and when it first starts its thread pool
    (RAYON_NUM_THREADS): call before this process encodes anything in parallel."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    if threads > 1:
        os.environ["RAYON_NUM_THREADS"] = str(threads)


def bucket_length(length: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if length <= b:
            return b
    return length


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenization:
    """A repository's tokenizer as served: a batch's texts in one call of the Rust tokenizer (it releases the GIL and
    may use several threads: use_tokenizer_threads), padded by it to the call's longest, as [n, S] arrays."""

    def __init__(self, tokenizer_dir: str | Path, uses_token_type_ids: bool, buckets: tuple[int, ...] = ()):
        """`buckets`: lengths the token tensors are padded up to (native GPU backends); () keeps the batch's own."""
        from tokenizers import Tokenizer

        tokenizer_dir = Path(tokenizer_dir)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        config = read_json(tokenizer_dir / "tokenizer_config.json")
        pad = _token_text(config.get("pad_token"))
        self.pad_id = (self.tokenizer.token_to_id(pad) if pad else None) or 0
        self.tokenizer.enable_padding(direction="right", pad_id=self.pad_id, pad_token=pad or "[PAD]")
        self.truncation_side = config.get("truncation_side", "right")
        self.uses_token_type_ids = uses_token_type_ids
        self.buckets = tuple(sorted(buckets))
        self.names = protocol.token_inputs(uses_token_type_ids)
        # ids without character offsets (tokenizers >= 0.20: ~15 % less CPU a text); a token task's words need the
        # offsets, so encode_words calls encode_batch itself
        self._encode_batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def encode(self, text: str, pair: str | None, max_length: int) -> dict[str, np.ndarray]:
        """One text's (+ pair's) token tensors, 1-D, unpadded; a blank text is refused as the server refuses it (a
        client that tokenizes on its own side: aot.Client(tokenizer=...))."""
        if is_blank(text):
            raise RequestError(BLANK_TEXT)
        return {name: a[0] for name, a in self.encode_batch([text], [pair], max_length).items()}

    def encode_batch(self, texts: list[str], pairs: list[str | None] | None, max_length: int) -> dict[str, np.ndarray]:
        """Texts (each with its pair, or None) truncated to `max_length`, in one call: [n, S] arrays right-padded to
        the longest (then up to a bucket)."""
        self.tokenizer.enable_truncation(max_length, strategy="longest_first", direction=self.truncation_side)
        items = texts if pairs is None else [(t, p) if p else t for t, p in zip(texts, pairs, strict=True)]
        return self._arrays(self._encode_batch(items))

    def encode_words(self, texts: list[str], max_length: int) -> tuple[dict[str, np.ndarray], list[Words], np.ndarray]:
        """A token task's texts: each split into words (aot.serving.words), its words joined by single spaces encoded
        in one call ([n, S] as encode_batch), and per token the word it starts ([n, S], -1: none, padding too):
        what training aligns tags with (aot.training.kinds.tokens.align)."""
        words = [split_words(text) for text in texts]
        self.tokenizer.enable_truncation(max_length, strategy="longest_first", direction=self.truncation_side)
        encodings = self.tokenizer.encode_batch([w.joined for w in words])
        tensors = self._arrays(encodings)
        first = np.full(tensors[protocol.INPUT_IDS].shape, -1, dtype=protocol.INDEX_DTYPE)
        for k, (w, enc) in enumerate(zip(words, encodings, strict=True)):
            first[k, : len(enc.ids)] = first_pieces(enc.offsets, enc.special_tokens_mask, w)
        return tensors, words, first

    def _arrays(self, encodings) -> dict[str, np.ndarray]:
        out = {protocol.INPUT_IDS: np.array([e.ids for e in encodings], dtype=protocol.TOKEN_DTYPE),
               protocol.ATTENTION_MASK: np.array([e.attention_mask for e in encodings], dtype=protocol.TOKEN_DTYPE)}
        if self.uses_token_type_ids:
            out[protocol.TOKEN_TYPE_IDS] = np.array([e.type_ids for e in encodings], dtype=protocol.TOKEN_DTYPE)
        return self.to_bucket(out)

    def to_bucket(self, tokens: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Token tensors [n, S] (right-padded) padded up to this step's bucket of S."""
        n = tokens[protocol.INPUT_IDS].shape[1]
        size = bucket_length(n, self.buckets)
        if size == n:
            return tokens
        fill = {protocol.INPUT_IDS: self.pad_id}
        return {name: np.pad(a, ((0, 0), (0, size - n)), constant_values=fill.get(name, 0))
                for name, a in tokens.items()}
