"""Tiny random encoders with matching tokenizers, built from configs in code (no hub, a few seconds)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertConfig, DebertaV2Config, PreTrainedTokenizerFast, RobertaConfig

from aot.training.backbone import Backbone, backbone_fingerprint, encoder_from_config

POSITIVE = ["good", "great", "superb", "lovely", "fine"]
NEGATIVE = ["bad", "awful", "poor", "dull", "boring"]
FILLER = [f"w{i}" for i in range(80)] + ["the", "a", "movie", "film", "plot", "actor"]

ARCHS = ("bert", "roberta", "deberta-v2")

_SPECIALS = {
    "bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    "deberta-v2": ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"],
}


def tiny_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    specials = _SPECIALS[arch]
    vocab = {tok: i for i, tok in enumerate(specials + POSITIVE + NEGATIVE + FILLER)}
    if arch == "roberta":
        pad, unk, cls, sep, mask = "<pad>", "<unk>", "<s>", "</s>", "<mask>"
    else:
        pad, unk, cls, sep, mask = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    pair_type = 1 if arch == "bert" else 0
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:{pair_type} {sep}:{pair_type}",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    names = ["input_ids", "token_type_ids", "attention_mask"] if arch == "bert" else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token=unk, cls_token=cls,
                                   sep_token=sep, mask_token=mask, model_max_length=64, model_input_names=names)


def tiny_config(arch: str, vocab_size: int, layers: int = 2, hidden: int = 32):
    # initializer_range 0.2: at the usual 0.02 a random 2-layer encoder passes almost nothing of the tokens to the
    # first position (its state varies by ~0.4 % across inputs), so no head-side method can learn anything there.
    common = dict(initializer_range=0.2, vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=2 * hidden, max_position_embeddings=72, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if arch == "bert":
        return BertConfig(**common, type_vocab_size=2, pad_token_id=0)
    if arch == "roberta":
        return RobertaConfig(**common, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return DebertaV2Config(**common, type_vocab_size=0, pad_token_id=0, relative_attention=True,
                           position_buckets=16, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                           max_relative_positions=-1, norm_rel_ebd="layer_norm", share_att_key=True)


def tiny_backbone(arch: str, seed: int = 0, layers: int = 2, hidden: int = 32) -> Backbone:
    import torch

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(arch)
    encoder = encoder_from_config(tiny_config(arch, len(tokenizer), layers, hidden))
    return Backbone(f"tiny-{arch}", encoder, tokenizer, backbone_fingerprint(encoder, tokenizer))


def save_tiny_model(arch: str, folder: Path, seed: int = 0) -> Path:
    backbone = tiny_backbone(arch, seed)
    backbone.encoder.save_pretrained(folder)
    backbone.tokenizer.save_pretrained(folder)
    return folder


def save_outlier_model(folder: Path, outlier: float = 30.0) -> Path:
    """The tiny BERT built to need care in int8: every LayerNorm's bias carries `outlier` in channel 3, so each
    layer's input has a wide range and the per-tensor activation scale is coarse (as real encoders' outlier channels
    do, only more so): its tasks lose dev points through the int8 graph (tests/test_int8*.py)."""
    import torch

    backbone = tiny_backbone("bert")
    with torch.no_grad():
        for module in backbone.encoder.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.bias[3] += outlier
    backbone.encoder.save_pretrained(folder)
    backbone.tokenizer.save_pretrained(folder)
    return folder


def sentiment_examples(n: int, seed: int, pair: bool = False) -> list[dict]:
    """Label is positive iff the text holds a positive word: learnable by a tiny model in seconds."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = "positive" if i % 2 == 0 else "negative"
        key = rng.choice(POSITIVE if label == "positive" else NEGATIVE)
        words = rng.sample(FILLER, rng.randint(3, 8))
        words.insert(rng.randint(0, len(words)), key)
        row = {"text": " ".join(words), "label": label}
        if pair:
            row["text_pair"] = " ".join(rng.sample(FILLER, 3))
        rows.append(row)
    return rows


def write_sentiment_folder(folder: Path, n_train: int = 400, n_dev: int = 100, fmt: str = "jsonl",
                           pair: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", n_train, 1), ("dev", n_dev, 2)):
        rows = sentiment_examples(n, seed, pair)
        path = folder / f"{split}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            sep = "\t" if fmt == "tsv" else ","
            path.write_text("text" + sep + "label\n" + "".join(f"{r['text']}{sep}{r['label']}\n" for r in rows))
    return folder


def tagged_examples(n: int, seed: int) -> list[dict]:
    """Token task rows: a positive word is a one-word `pos` entity (sometimes with "!" attached: one word of two
    pieces for the tiny tokenizer), a negative word and the word after it a two-word `neg` entity."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        tokens, tags = [], []
        for _ in range(rng.randint(3, 8)):
            kind = rng.random()
            if kind < 0.2:
                tokens.append(rng.choice(POSITIVE) + ("!" if rng.random() < 0.3 else ""))
                tags.append("B-pos")
            elif kind < 0.35:
                tokens += [rng.choice(NEGATIVE), rng.choice(["movie", "film", "plot"])]
                tags += ["B-neg", "I-neg"]
            else:
                tokens.append(rng.choice(FILLER[:40]))
                tags.append("O")
        rows.append({"tokens": tokens, "tags": tags})
    return rows


def multilabel_examples(n: int, seed: int) -> list[dict]:
    """Labels `pos` and `neg` for the sentiment words a text holds: none, one or both."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words, labels = rng.sample(FILLER, rng.randint(3, 6)), []
        for label, pool in (("neg", NEGATIVE), ("pos", POSITIVE)):
            if rng.random() < 0.5:
                words.insert(rng.randint(0, len(words)), rng.choice(pool))
                labels.append(label)
        rows.append({"text": " ".join(words), "labels": labels})
    return rows


def pair_examples(n: int, seed: int, scored: bool = False) -> list[dict]:
    """Retrieval pairs: the positive shares the anchor's two key words (a score: how many it shares, scored)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        key = rng.sample(FILLER[:40], 2)
        shared = rng.randint(0, 2) if scored else 2
        row = {"text": " ".join(key + rng.sample(FILLER[40:80], 2)),
               "text_pair": " ".join(rng.sample(FILLER[40:80], 3) + key[:shared] + rng.sample(FILLER[:40], 2 - shared))}
        if scored:
            row["score"] = shared / 2
        rows.append(row)
    return rows


def score_examples(n: int, seed: int) -> list[dict]:
    """Regression rows: the score is the share of the text's sentiment words that are positive (0, 0.5 or 1)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words, good = rng.sample(FILLER, rng.randint(3, 6)), rng.randint(0, 2)
        for pool in [POSITIVE] * good + [NEGATIVE] * (2 - good):
            words.insert(rng.randint(0, len(words)), rng.choice(pool))
        rows.append({"text": " ".join(words), "label": good / 2})
    return rows


# Each kind's tiny rows (aot.serving.kinds.KINDS: a new kind adds its own), and the tiny task of each kind that
# conftest.kind_artifacts trains (name -> kind): the table tests/test_kinds_served.py runs end to end.
KIND_ROWS = {"classification": sentiment_examples, "regression": score_examples, "tokens": tagged_examples,
             "multilabel": multilabel_examples, "embedding": pair_examples}
KIND_TASKS = {"cls": "classification", "score": "regression", "ner": "tokens", "tags": "multilabel",
              "search": "embedding"}


def write_kind_folder(folder: Path, kind: str, n_train: int = 320, n_dev: int = 80) -> Path:
    """A plain data folder (train.jsonl, dev.jsonl) of a `--problem` kind (KIND_ROWS)."""
    make = KIND_ROWS[kind]
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", n_train, 3), ("dev", n_dev, 4)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make(n, seed)))
    return folder
