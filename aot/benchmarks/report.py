"""Writing benchmark results: JSON records, a Markdown table, a plot. Shared by every `aot bench` command."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from aot.serving.store import atomic


def percentile(values: Sequence[float], share: float) -> float | None:
    """The value below which `share` of `values` lie (the nearest rank below), rounded to 0.1; None for none."""
    ordered = sorted(values)
    return round(ordered[int(share * (len(ordered) - 1))], 1) if ordered else None


def write_json(path: Path, data) -> None:
    """Atomic (aot.serving.store.atomic): a crash leaves the previous file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, data)


def markdown_table(rows: Sequence[dict], columns: Sequence[str], headers: Sequence[str] | None = None,
                   formats: dict[str, str] | None = None) -> str:
    formats = formats or {}
    headers = headers or columns

    def cell(row, col):
        value = row.get(col, "")
        if value is None:
            return "-"
        fmt = formats.get(col)
        return format(value, fmt) if fmt and isinstance(value, (int, float)) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_atomic(path, text)


def new_figure(width: float = 8, height: float = 4.5, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, height))


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
