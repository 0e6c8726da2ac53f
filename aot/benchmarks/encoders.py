"""Random-weight encoders of a chosen shape with a real model's tokenizer and vocabulary, built in code (no download):
what the benchmarks serve when speed matters and accuracy does not.

    NEGLIGIBLE  1 layer, hidden 64: an encoder whose compute is negligible beside the serving path around it, so that
                `aot bench tax --engine torch` measures the path itself (tokenizer, batching, heads, answers, Triton)
    BASE        RoBERTa-base's compute shape (12 layers, hidden 768, 12 heads, FFN 3072) in a BERT config

`python -m aot.benchmarks.encoders SOURCE DEST SHAPE` builds one from the shell (scripts/gpu-check.sh): SOURCE a
model folder (or `minilm`), whose weights are not read; SHAPE negligible, base, or source (the source's own).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

NEGLIGIBLE = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 256}
BASE = {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072}
SHAPES = {"negligible": NEGLIGIBLE, "base": BASE, "source": {}}
WEIGHTS = (".safetensors", ".bin", ".h5", ".msgpack", ".onnx", ".ot")  # a source's files that are not copied


def random_encoder(source: str, dest: Path, dims: dict, seed: int = 0) -> Path:
    """`dest`: the model folder of `source` (a folder, or the `minilm` alias) with its config changed by `dims`
    (config fields) and random weights (seeded); its tokenizer and other files copied, its weights not. A folder that
    already holds weights is left as it is."""
    import torch
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging

    from aot.training.backbone import resolve_model_path

    dest = Path(dest)
    if (dest / "model.safetensors").is_file():
        return dest
    src = Path(resolve_model_path(source))
    dest.mkdir(parents=True, exist_ok=True)
    for path in src.rglob("*"):
        if path.is_file() and not path.name.endswith(WEIGHTS) and path.name not in (".gitattributes", "README.md"):
            (dest / path.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / path.relative_to(src))
    config = AutoConfig.from_pretrained(str(src), **dims)
    pooling = dest / "1_Pooling" / "config.json"  # a sentence-transformers folder states the pooled width there
    if pooling.is_file():
        pooling.write_text(json.dumps({**json.loads(pooling.read_text()),
                                       "word_embedding_dimension": config.hidden_size}))
    logging.disable_progress_bar()
    torch.manual_seed(seed)
    AutoModel.from_config(config).save_pretrained(str(dest))
    return dest


if __name__ == "__main__":  # scripts/gpu-check.sh: SOURCE DEST SHAPE
    if len(sys.argv) != 4 or sys.argv[3] not in SHAPES:
        sys.exit(f"usage: python -m aot.benchmarks.encoders SOURCE DEST SHAPE (SHAPE: {', '.join(SHAPES)})")
    random_encoder(sys.argv[1], Path(sys.argv[2]), SHAPES[sys.argv[3]])
