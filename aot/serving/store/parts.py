"""A large change set of the store's log in parts (format 5, aot.serving.store.log): no object of the log costs a
reader more than about MAX_CHANGE_BYTES to parse, whatever a batch publishes.

    parts/<generation>-<token>-<k>.json   {"generation", "part": k, "tasks", "retired", "tenants"}: part k of the
                                          change set of `generation`, written once before the log that names them
                                          (`token`: one writer's attempt, so that two racing writers never collide)

A writer that loses the race for its generation deletes its parts; a compaction deletes the parts of the logs it
deletes.
"""

from __future__ import annotations

import json
import re
import uuid

from aot.serving.formats import FormatError
from aot.serving.store.layout import PARTS

MAX_CHANGE_BYTES = 1 << 20  # a change set larger than this as JSON is written in parts of about this size each
SECTIONS = ("tasks", "retired", "tenants")
_PART = re.compile(rf"{PARTS}/(?P<generation>[0-9]{{16}})-[0-9a-f]{{12}}-(?P<part>[0-9]{{4}})\.json")


def part_key(generation: int, token: str, part: int) -> str:
    return f"{PARTS}/{generation:016d}-{token}-{part:04d}.json"


def part_generation(key: str) -> int | None:
    """The generation of a part's key; None for any other name."""
    match = _PART.fullmatch(key)
    return None if match is None else int(match["generation"])


def part_keys(value: dict, generation: int, where: str) -> list[str]:
    """The parts a log names, checked: keys of this generation's parts, in order (never a path elsewhere)."""
    keys = value.get("parts")
    matches = [_PART.fullmatch(k) if isinstance(k, str) else None for k in keys] if isinstance(keys, list) else [None]
    if not keys or not all(m and int(m["generation"]) == generation and int(m["part"]) == i
                           for i, m in enumerate(matches)):
        raise FormatError(f"{where}: 'parts' must list this generation's part keys in order")
    return keys


def split(sections: dict[str, dict], limit: int = MAX_CHANGE_BYTES) -> list[dict[str, dict]]:
    """A change set's sections (SECTIONS: name -> its object) in parts of about `limit` bytes of JSON each; an entry
    larger than that is a part of its own."""
    parts: list[dict[str, dict]] = [{section: {} for section in SECTIONS}]
    size = 0
    for section in SECTIONS:
        for key, value in sections.get(section, {}).items():
            cost = len(key) + len(json.dumps(value, separators=(",", ":"))) + 8
            if size + cost > limit and size:
                parts.append({s: {} for s in SECTIONS})
                size = 0
            parts[-1][section][key] = value
            size += cost
    return parts


def write_parts(backend, generation: int, parts: list[dict[str, dict]]) -> dict[str, int]:
    """Write a change set's parts (split) for `generation`: their keys, in order, -> their bytes."""
    token, written = uuid.uuid4().hex[:12], {}
    for i, part in enumerate(parts):
        body = json.dumps({"generation": generation, "part": i, **part}, separators=(",", ":")).encode()
        key = part_key(generation, token, i)
        backend.create(key, body)
        written[key] = len(body)
    return written
