"""The linter CI runs (pyproject.toml [tool.ruff]): a small rule set the code meets, so that every `noqa` marker
suppresses something real (RUF100 refuses one that suppresses nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).with_name("ruff")


def test_ruff_passes():
    done = subprocess.run([str(RUFF), "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_catches_a_planted_fault(tmp_path):
    """The check itself: an unused import, a blind except and a stale noqa are each reported."""
    bad = tmp_path / "aot" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import os\n\n\ndef f():\n    try:\n        return 1\n    except Exception:\n        return 2\n\n\n"
                   "x = 1  # noqa: E731\n")
    done = subprocess.run([str(RUFF), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 1
    for rule in ("F401", "BLE001", "RUF100"):
        assert rule in done.stdout, done.stdout
