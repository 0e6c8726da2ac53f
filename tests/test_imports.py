"""Imports flow one way (pyproject.toml [tool.importlinter]): the packages in layers, no circle of modules. The
contracts are checked by import-linter, which reads every import, those inside functions included."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("aot", "benchmarks", "exporter", "training", "serving_torch", "serving")


def _lint(root: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", str(root / "pyproject.toml")], cwd=root, capture_output=True,
                          text=True, timeout=300)


def test_imports_flow_one_way():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, planted, broken", [
    ("serving/protocol.py", "import training.metrics  # noqa: F401\n", "Packages in layers"),
    ("serving/protocol.py", "from serving import steps  # noqa: F401\n", "No circles"),
    ("training/model.py", "def _late():\n    from training import factory  # noqa: F401\n", "No circles"),
])
def test_a_planted_upward_arrow_or_circle_is_caught(tmp_path, module, planted, broken):
    """The check itself: a copy of the project with one bad import planted (at module level or hidden in a
    function) breaks the contract it should."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert _lint(tmp_path).returncode == 0
    with open(tmp_path / module, "a") as f:
        f.write("\n" + planted)
    result = _lint(tmp_path)
    assert result.returncode == 1
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout
