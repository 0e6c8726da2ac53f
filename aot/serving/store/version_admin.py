"""`aot export versions | rollback | route`: the versions a task keeps, and which of them its bare name answers.

A task keeps its last `keep` versions (`aot export task --keep N`, default aot.serving.store.reader.DEFAULT_KEEP; the
current one included): each stays servable by pin (`TASK@<id>`) for as long as it is kept, whatever its age, and a
version pushed out is retired (servable RETIRED_GRACE seconds more, then deleted). A rollback makes a kept version
current again (the current one becomes kept); a route splits the bare name's requests between kept versions by weight,
one draw per request (aot.serving.task_registry), each answer naming its version; `CURRENT` names the current version
(`route NAME CURRENT=90 NAME@ID=10`, and `route NAME CURRENT=1` clears the route). Publishing a new version, or a
rollback, clears the route. A rollback or route to a version of other labels, kind or pair-ness than the current one is
refused unless allowed, as a publish is (aot.serving.store.compatibility). Every command is one change of the store's
index: servers follow it from their next batch.
"""

from __future__ import annotations

import time

from aot.serving.formats import iso_time
from aot.serving.store.compatibility import check_same_labels, current_version, dev_note
from aot.serving.store.entry_history import as_kept, held_versions
from aot.serving.store.log import Change, StoreState
from aot.serving.store.reader import (
    RETIRED_GRACE,
    StoreError,
    check_route_weights,
    check_task_name,
    check_version,
    parse_entry,
    task_of,
)
from aot.serving.store.writer import TaskStore


def _entry(store: TaskStore, state: StoreState, name: str) -> dict:
    check_task_name(name)
    if name not in state.tasks:
        raise StoreError(f"unknown task {name!r} in {store.location} (aot export list names its tasks)")
    return state.tasks[name]


def list_versions(store: TaskStore, name: str) -> list[dict]:
    """Every version of task `name` the store still serves by pin, newest first: the current one, the kept ones,
    and retired ones within their grace (with the seconds left)."""
    state = store.state()
    raw = _entry(store, state, name)
    entry = parse_entry(name, raw, "the store's index")
    route = entry.route or {}
    out = []
    for held in entry.held().values():
        current = held.version == entry.folder
        out.append({"version": held.version, "status": "current" if current else "kept", "storage": held.storage,
                    **{k: held.meta.get(k) for k in ("metric", "dev")},
                    "since": iso_time(raw.get("time") if current else held.time),
                    "route_share": round(route[held.version], 4) if held.version in route else None})
    now = time.time()
    for version, info in sorted(state.retired.items(), key=lambda item: -item[1].get("time", 0)):
        left = RETIRED_GRACE - (now - info.get("time", 0))
        if task_of(version) == name and left > 0:
            out.append({"version": version, "status": "retired", "since": iso_time(info.get("time")),
                        "expires_in_seconds": round(left)})
    return out


CURRENT = "CURRENT"  # in a route, the task's current version (whatever its id)


def rollback(store: TaskStore, name: str, version: str, allow_label_change: bool = False,
             notes: list[str] | None = None) -> str:
    """Make kept `version` the current version of `name`; returns the version it replaced. A version of other labels,
    kind or pair-ness is refused unless `allow_label_change`; `notes` gets what is said of it (a lower dev score)."""
    _check_of(name, version)
    replaced: list[str] = []

    def change(state: StoreState) -> Change:
        entry = _entry(store, state, name)
        kept = {k["folder"]: k for k in entry.get("kept", [])}
        if version == entry["folder"]:
            raise StoreError(f"{version} is already the current version of {name!r}")
        if version not in kept:
            raise StoreError(f"{version} is not a version {name!r} keeps (aot export versions {name} --repo REPO "
                             "lists them)")
        target = kept[version]
        current, new = current_version(entry), (version, target.get("meta") or {})
        check_same_labels(name, current, new, allow_label_change, "rolling back to")
        if notes is not None:
            notes[:] = [note for note in [dev_note(name, current, new)] if note]
        rest = [as_kept(entry)] + [k for k in entry.get("kept", []) if k["folder"] != version]
        new = {k: v for k, v in entry.items() if k not in ("folder", "storage", "digests", "meta", "kept", "route")}
        new.update({k: target[k] for k in ("folder", "storage", "digests", "meta") if k in target}, kept=rest,
                   time=time.time())
        replaced[:] = [entry["folder"]]
        return Change(tasks={name: new})

    store.commit(change)
    return replaced[0]


def route(store: TaskStore, name: str, weights: dict[str, float], allow_label_change: bool = False,
          notes: list[str] | None = None) -> dict[str, float] | None:
    """Split the bare name's requests between kept versions by weight (finite positive numbers whose total is at
    most MAX_ROUTE_TOTAL; CURRENT: the current version); one version that is the current one clears the route.
    A routed version of other labels, kind or pair-ness than the current one is refused unless `allow_label_change`;
    `notes` gets what is said of them (a lower dev score). Returns the route set (None: cleared)."""
    if not weights:
        raise StoreError("give at least one VERSION=WEIGHT")
    for version in weights:
        if version != CURRENT:
            _check_of(name, version)
    check_route_weights(weights)
    chosen: list[dict | None] = []

    def change(state: StoreState) -> Change:
        entry = _entry(store, state, name)
        routed = _resolved(weights, entry["folder"])
        held = set(held_versions(entry))
        missing = sorted(set(routed) - held)
        if missing:
            raise StoreError(f"{', '.join(missing)}: not a version {name!r} keeps (aot export versions {name} "
                             "--repo REPO lists them)")
        current, metas = current_version(entry), {k["folder"]: k.get("meta") or {} for k in entry.get("kept", [])}
        said = []
        for version in routed:
            if version != entry["folder"]:
                check_same_labels(name, current, (version, metas[version]), allow_label_change, "routing to")
                said.append(dev_note(name, current, (version, metas[version]), "the current version it answers beside"))
        if notes is not None:
            notes[:] = [note for note in said if note]
        new = dict(entry)
        new.pop("route", None)
        if set(routed) != {entry["folder"]}:
            new["route"] = routed
        chosen[:] = [new.get("route")]
        return Change(tasks={name: new})

    store.commit(change)
    return chosen[0]


def parse_weights(pairs: list[str]) -> dict[str, float]:
    """`VERSION=WEIGHT` arguments -> {version: weight}."""
    weights = {}
    for pair in pairs:
        version, sep, weight = pair.rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not sep or value is None:
            raise StoreError(f"{pair!r}: expected VERSION=WEIGHT (a version as answers name it, NAME@ID, or CURRENT, and a "
                             "positive number)")
        if version in weights:
            raise StoreError(f"{version} is given twice")
        weights[version] = value
    return weights


def _resolved(weights: dict[str, float], current: str) -> dict[str, float]:
    """The weights with CURRENT replaced by the current version (refused when that version is named twice)."""
    if CURRENT not in weights:
        return dict(weights)
    if current in weights:
        raise StoreError(f"{current} is the current version: give it once (as {CURRENT} or by name)")
    return {current if version == CURRENT else version: weight for version, weight in weights.items()}


def _check_of(name: str, version: str) -> None:
    check_version(version)
    if task_of(version) != name:
        raise StoreError(f"{version} is a version of {task_of(version)!r}, not of {name!r}")
