"""What `aot export repair` discards, in words: the change a damaged log made, as far as its bytes still read ("the
route of t0 (t0@… 90 %, t0@… 10 %) set at 2025-01-01T10:00:00Z"), so that an operator learns what to do again, not a
generation number.

A log is written as one JSON object, generation, time, then the tasks it changed (aot.serving.store.log): a log cut
short keeps its first entries whole, and each of them is read here on its own (the entry it was cut in, as far as it
goes: its task is named); a log overwritten with other bytes, or one in parts whose part is damaged, tells nothing but
its generation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from aot.serving.formats import iso_time
from aot.serving.store.entry_history import held_versions

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")
_TIME = re.compile(r'"time"\s*:\s*(-?[0-9.eE+]+)')


@dataclass
class Salvaged:
    """What a damaged log still tells: when it was written and the entries it holds whole before the damage."""

    time: float | None = None
    tasks: dict[str, object] = field(default_factory=dict)
    tenants: dict[str, object] = field(default_factory=dict)


def salvage(data: bytes | None) -> Salvaged:
    found = Salvaged()
    text = (data or b"").decode("utf-8", "replace")
    head = _TIME.search(text[:256])
    if head:
        try:
            found.time = float(head.group(1))
        except ValueError:
            pass
    for section in ("tasks", "tenants"):
        start = re.search(rf'"{section}"\s*:\s*\{{', text)
        if start is not None:
            getattr(found, section).update(_members(text, start.end(), depth=0 if section == "tasks" else 1))
    return found


class CutShort(dict):
    """An entry whose object was cut short: the members before the cut."""


def _members(text: str, at: int, depth: int = 0) -> dict[str, object]:
    """The `"key": value` members of the object whose body starts at `at`, up to the first that does not read (an
    object value cut short, at the top: as far as it goes, CutShort)."""
    members: dict[str, object] = {}
    while True:
        at = _SPACE.match(text, at).end()
        if not text.startswith('"', at):
            return members
        try:
            key, at = json.decoder.scanstring(text, at + 1)
        except (ValueError, IndexError):
            return members
        at = _SPACE.match(text, at).end()
        if not text.startswith(":", at):
            return members
        at = _SPACE.match(text, at + 1).end()
        try:
            value, at = _DECODER.raw_decode(text, at)
        except (ValueError, IndexError):
            if depth == 0 and text.startswith("{", at):
                members[key] = CutShort(_members(text, at + 1, depth + 1))
            return members
        members[key] = value
        at = _SPACE.match(text, at).end()
        if not text.startswith(",", at):
            return members
        at += 1


def _route(route: dict) -> str:
    total = sum(w for w in route.values() if isinstance(w, (int, float))) or 1
    return ", ".join(f"{v} {100 * w / total:.3g} %" for v, w in route.items() if isinstance(w, (int, float)))


def task_change(name: str, entry, before) -> str:
    """The change of task `name` to `entry` (None: removed) from `before` (its entry then; None: none; ...: unknown),
    in words."""
    if entry is None:
        return f"the removal of task {name}"
    if isinstance(entry, CutShort):
        folder = entry.get("folder")
        if isinstance(before, dict) and folder == before.get("folder"):
            return f"a change of task {name}, its current version still {folder} (the rest of its entry is cut short)"
        version = f" to {folder}" if isinstance(folder, str) else ""
        return f"a change of task {name}{version} (its entry is cut short: what else it set cannot be read)"
    if not isinstance(entry, dict):
        return f"a change of task {name}"
    if before is None or not isinstance(before, dict):
        return f"the publish of {entry.get('folder', name)}" + (" (its first version)" if before is None else "")
    if entry.get("folder") != before.get("folder"):
        if entry.get("folder") in held_versions(before):
            return f"the rollback of {name} to {entry['folder']}"
        return f"the publish of {entry.get('folder')} (replacing {before.get('folder')})"
    if entry.get("route") != before.get("route"):
        route = entry.get("route")
        if isinstance(route, dict):
            return f"the route of {name} ({_route(route)})"
        return f"the clearing of {name}'s route"
    if entry.get("keep") != before.get("keep"):
        return f"the retention of {name} (keep {entry.get('keep')})"
    return f"a change of task {name}'s entry"


def lost_log(generation: int, data: bytes | None, why: str, before) -> str:
    """A damaged log that a repair discards, in words; `before(name)`: the task's entry before it (None: none; ...:
    unknown)."""
    found = salvage(data)
    when = f"written {iso_time(found.time)}" if found.time is not None else "its time unreadable"
    said = [task_change(name, entry, before(name)) for name, entry in found.tasks.items()]
    said += [f"the deletion of tenant {tenant}" if record is None else f"a key of tenant {tenant} (made or rotated)"
             for tenant, record in found.tenants.items()]
    what = f"lost {'; '.join(said)} (as far as it reads)" if said else "what it changed cannot be read, and is lost"
    return f"log {generation} ({when}) does not parse ({why}) and was discarded: {what}"
