"""tests/README.md maps every module of the `aot` package to the tests that exercise it: a module added without a line
there, or a test file renamed or removed while the map still names it, fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "tests" / "README.md"
TEST_FILE = re.compile(r"\b((?:test_\w+|helpers|tiny|conftest)\.py)\b")
UNTESTED = "not exercised by the suite"


def dotted(path: Path) -> str:
    """A file's dotted name (a template's `1` folder included; a package by its folder)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[str]:
    """Every module under aot/ by dotted name, without __init__ and __main__: each must have its line."""
    return [dotted(p) for p in sorted((ROOT / "aot").rglob("*.py")) if p.stem not in ("__init__", "__main__")]


def existing() -> set[str]:
    """Every name a line may open with: the modules, the packages and the __main__ modules."""
    return {dotted(p) for p in (ROOT / "aot").rglob("*.py")}


def module_lines(text: str) -> dict[str, str]:
    """The map's bullets: the module each one opens with -> the rest of its line."""
    lines = {}
    for line in text.splitlines():
        match = re.match(r"- `(aot(?:\.[\w]+)*)`:(.*)", line)
        if match:
            assert match[1] not in lines, f"{match[1]} is listed twice"
            lines[match[1]] = match[2]
    return lines


def test_tests_readme_maps_every_module():
    text = README.read_text()
    lines = module_lines(text)
    wanted = modules()
    assert len(wanted) > 100, len(wanted)  # the walk found the package
    missing = [m for m in wanted if m not in lines]
    assert not missing, f"modules without a line in tests/README.md: {missing}"
    stale = sorted(set(lines) - existing())
    assert not stale, f"tests/README.md lists modules that do not exist: {stale}"
    for module in wanted:
        line = lines[module]
        assert TEST_FILE.search(line) or UNTESTED in line, f"{module}: names no test file, nor says it is untested"
    named = set(TEST_FILE.findall(text))
    assert len(named) > 30, named  # the map names the suite's files
    gone = sorted(n for n in named if not (ROOT / "tests" / n).is_file())
    assert not gone, f"tests/README.md names test files that do not exist: {gone}"
