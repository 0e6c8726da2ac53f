"""How a task's entry in the store's index keeps its history (format 3 and on): the versions it keeps besides the
current one, the versions it retires (servable RETIRED_GRACE seconds for requests pinned to them), and the retired
versions past their grace. Pure functions of raw entries (aot.serving.store.log): the writer
(aot.serving.store.writer), rollbacks and routes (aot.serving.store.version_admin) and tenants
(aot.serving.store.tenant_admin) compute their changes with them."""

from __future__ import annotations

import time

from aot.serving.store.log import StoreState
from aot.serving.store.reader import DEFAULT_KEEP, RETIRED_GRACE


def retire(entry) -> dict[str, dict]:
    """A replaced or removed version, kept with its digests for requests pinned to it (for RETIRED_GRACE seconds;
    when that is 0, marked gone at once: None, which the change's clean-up removes)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("folder"), str):
        return {}
    if RETIRED_GRACE <= 0:
        return {entry["folder"]: None}
    info = {"time": time.time()}
    if isinstance(entry.get("digests"), dict):
        info["digests"] = entry["digests"]
    return {entry["folder"]: info}


def retire_all(entry) -> dict[str, dict]:
    """A removed task's current and kept versions, retired."""
    retired = retire(entry)
    for kept in entry.get("kept", []) if isinstance(entry, dict) else []:
        retired.update(retire(kept))
    return retired


def held_versions(entry: dict) -> list[str]:
    """The versions a raw entry holds: its current one and its kept ones."""
    kept = [k["folder"] for k in entry.get("kept", []) if isinstance(k, dict) and isinstance(k.get("folder"), str)]
    return ([entry["folder"]] if isinstance(entry.get("folder"), str) else []) + kept


def with_history(new: dict, old: dict | None, keep: int | None) -> tuple[dict, dict[str, dict]]:
    """The entry of a newly published version `new` over the task's entry `old`: the old current version goes first
    among the kept ones, the task keeps its retention (or takes `keep`), and what falls beyond it is retired. A new
    version clears a route. Returns the entry and the versions retired."""
    old = old if isinstance(old, dict) else {}
    keep = keep or old.get("keep") or DEFAULT_KEEP
    history = ([as_kept(old)] if isinstance(old.get("folder"), str) else []) + list(old.get("kept", []))
    history = [k for k in history if isinstance(k, dict) and k.get("folder") != new["folder"]]
    retired = {}
    for gone in history[keep - 1:]:
        retired.update(retire(gone))
    return {**new, "keep": keep, "kept": history[:keep - 1]}, retired


def as_kept(entry: dict) -> dict:
    """A current version's entry as a kept one: the same fields, and since when it is no longer current."""
    return {k: entry[k] for k in ("folder", "storage", "digests", "meta") if k in entry} | {"time": time.time()}


def expired(state: StoreState) -> dict[str, None]:
    """Retired versions past their grace: dropped from the index by the next change."""
    now = time.time()
    return {v: None for v, info in state.retired.items()
            if not isinstance(info.get("time"), (int, float)) or now - info["time"] >= RETIRED_GRACE}
