"""What every `aot` command prints: results as JSON on standard output, for scripts and pipes; for people, on
standard error, a short summary and the next step (beside progress, warnings and errors)."""

from __future__ import annotations

import json
import sys


def report(result: dict | list[dict], *summary: str) -> None:
    """`result` as one JSON line (a list: one line per item; text as it is, not escaped), then the summary lines,
    each prefixed `aot: `."""
    for item in result if isinstance(result, list) else [result]:
        print(json.dumps(item, ensure_ascii=False), flush=True)
    for line in summary:
        print(f"aot: {line}", file=sys.stderr, flush=True)


def example_texts(has_pair: bool | None) -> str:
    """The texts a "next:" hint calls a task with (aot predict, aot infer): a task trained on text pairs takes its
    second text with --pair, or the call it suggests would be refused."""
    return '--pair "a second text" "some text"' if has_pair else '"some text"'


# The extra that brings each top-level package a command may need (`pip install '.[EXTRA]'`).
EXTRA_OF_MODULE = {"torch": "train", "peft": "train", "transformers": "train",
                   "sklearn": "train", "onnx": "export", "onnxscript": "export", "matplotlib": "bench",
                   "onnxruntime": "serve", "tokenizers": "serve", "tritonclient": "client", "tqdm": "client"}


def install_hint(extra: str) -> str:
    """How to install an extra: from a checkout, since no package index serves aot-ptuning."""
    return (f"pip install '.[{extra}]' in a checkout of this project (no package index serves aot-ptuning; bash "
            "scripts/setup.sh installs every extra)")


def missing_extra(exc: ImportError) -> int:
    """A command whose package is not installed: the extra that brings it, named on standard error; exit code 2."""
    module = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(module, "train")
    print(f"aot: error: this command needs the [{extra}] extra (module {module or exc} is missing): "
          f"{install_hint(extra)}", file=sys.stderr)
    return 2
