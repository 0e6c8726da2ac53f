"""References into the docs hold: every `docs/NAME.md, "Title"` that code, scripts or docs write names a heading of
that document, so that moving or renaming a section fails here instead of leaving a dangling pointer."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"""docs/([\w-]+\.md),\s+(?:section\s+)?(["'])(.+?)\2""", re.S)


def _headings(document: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in document.read_text().splitlines() if line.startswith("#")]


def test_every_reference_to_a_section_names_a_heading():
    sources = [*sorted((ROOT / "aot").rglob("*.py")), *sorted(p for p in (ROOT / "tests").glob("*.py") if p != Path(__file__)),
               *sorted((ROOT / "scripts").glob("*.sh")), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    references, dangling = 0, []
    for path in sources:
        for match in REFERENCE.finditer(path.read_text()):
            document, title = match.group(1), " ".join(match.group(3).split())
            if "{" in title:  # a format string, not a reference
                continue
            references += 1
            if not any(title in heading for heading in _headings(ROOT / "docs" / document)):
                dangling.append(f"{path.relative_to(ROOT)}: docs/{document}, {title!r}")
    assert references >= 30, "the scan found too few references: it reads nothing"
    assert not dangling, "sections that no heading names:\n" + "\n".join(dangling)


def test_serving_md_has_headings_not_bold_paragraph_titles():
    text = (ROOT / "docs" / "serving.md").read_text()
    assert not re.findall(r"^\*\*[^*]+\*\*", text, re.M)
    assert len(_headings(ROOT / "docs" / "serving.md")) >= 20
