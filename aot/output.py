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
