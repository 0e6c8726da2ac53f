"""Imports flow one way (pyproject.toml [tool.importlinter]): the packages in layers, serving's two rooms (the task
store, the supervision) independent, the store's format written in its room alone (the exporter publishes through its
writer; no server imports the writer), the benchmarks' rooms in layers, no circle of modules. The contracts are
checked by import-linter, which reads every import, those inside functions included. And every module stays short."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint(root: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), str(root / "pyproject.toml")], cwd=root, capture_output=True,
                          text=True, timeout=300)


def test_imports_flow_one_way():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, planted, broken", [
    ("aot/serving/protocol.py", "import aot.training.metrics  # noqa: F401\n", "Packages in layers"),
    ("aot/client/errors.py", "import aot.local.processes  # noqa: F401\n", "Packages in layers"),
    ("aot/serving/protocol.py", "from aot.serving import steps  # noqa: F401\n", "No circles"),
    ("aot/training/model.py", "def _late():\n    from aot.training import factory  # noqa: F401\n", "No circles"),
    ("aot/serving/supervision/probes.py", "from aot.serving.store import reader  # noqa: F401\n", "Serving's rooms"),
    ("aot/serving/store/digests.py", "def _late():\n    from aot.serving.supervision import procfs  # noqa: F401\n",
     "Serving's rooms"),
    ("aot/exporter/task_export.py", "from aot.serving.store.log import Change  # noqa: F401\n",
     "The store's format is written in its room"),
    ("aot/cli/export.py", "def _late():\n    from aot.serving.store import entry_history  # noqa: F401\n",
     "The store's format is written in its room"),
    ("aot/serving/steps.py", "def _late():\n    from aot.serving.store.writer import TaskStore  # noqa: F401\n",
     "A server reads the store"),
    ("aot/serving/store/reader.py", "def _late():\n    from aot.serving.store import version_admin  # noqa: F401\n",
     "A server reads the store"),
    ("aot/benchmarks/served/serve.py", "def _late():\n    from aot.benchmarks.tax import onnx_engine  # noqa: F401\n",
     "The benchmarks' rooms in layers"),
    ("aot/benchmarks/report.py", "def _late():\n    from aot.benchmarks.accuracy import plan  # noqa: F401\n",
     "The benchmarks' rooms in layers"),
])
def test_a_planted_upward_arrow_or_circle_is_caught(tmp_path, module, planted, broken):
    """The check itself: a copy of the project with one bad import planted (at module level or hidden in a
    function) breaks the contract it should."""
    shutil.copytree(ROOT / "aot", tmp_path / "aot", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert _lint(tmp_path).returncode == 0
    with open(tmp_path / module, "a") as f:
        f.write("\n" + planted)
    result = _lint(tmp_path)
    assert result.returncode == 1
    verdict = re.search(rf"{re.escape(broken)}.*? (KEPT|BROKEN)\b", " ".join(result.stdout.split()))
    assert verdict is not None and verdict.group(1) == "BROKEN", result.stdout


def test_every_package_names_its_modules():
    """Each package's __init__ docstring maps its rooms: every module, subpackage and Triton model folder in it is
    named there, so the tree and its map cannot drift apart."""
    packages = sorted((ROOT / "aot").rglob("__init__.py"))
    assert len(packages) >= 14
    for init in packages:
        package = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
        names |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file() or (p / "1" / "model.py").is_file()}
        missing = sorted(n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}\b", doc))
        assert not missing, f"{package.relative_to(ROOT)}/__init__.py does not name {missing}"


def test_an_installed_project_adds_one_top_level_package(tmp_path):
    """The wheel an install builds holds `aot` alone: no generic name (serving, training, ...) lands in an
    application's site-packages beside its own modules."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("aot_ptuning-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"aot"}, tops
    assert "aot/serving/store/reader.py" in names and "aot/model_repository/fused/1/model.py" in names


MAX_MODULE_LINES = 450  # a module past this holds more than one job: split it (the house's aim is ~400)


def test_modules_stay_short():
    """Every module of the package and every python model fits in MAX_MODULE_LINES lines."""
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines()) for path in sorted((ROOT / "aot").rglob("*.py"))}
    assert len(sizes) > 100, "the scan found too few modules"
    long = {str(path): n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
