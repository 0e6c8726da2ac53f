"""Replacing one instance of a python step while its siblings keep serving: Triton's in-place model update.

Triton 2.51 has no API to restart one instance, but loading a READY model again with a config that differs from the
loaded one only in `instance_group` updates the model in place (core: ModelLifeCycle::UpdateModelConfig ->
TritonModel::UpdateInstanceGroup): the model is never unloaded, instances whose group is unchanged keep running
with their queues, instances of groups that left are removed from the scheduler, and new groups get new
instances. Triton tells instances apart by their group with `name` and `count` ignored (EquivalentInInstanceConfig),
so an instance can be replaced alone only when it has a group of its own that differs from its siblings' in some
other field: the exported configs give each instance of a multi-instance python step its own group with its own
`host_policy` (aot.exporter.configs; an unknown host policy name means Triton's defaults, as no policy does), and a
replacement gets a fresh name used as both (`aot_1` -> `aot_1_r1` -> `aot_1_r2`). What a repair by update costs
against unload + load: docs/serving.md, "A dead step is repaired".
"""

from __future__ import annotations

import copy
import re

_GENERATION = re.compile(r"^(?P<base>.+?)_r(?P<n>\d+)$")
_COMPARED = ("kind", "gpus", "secondary_devices", "profile", "passive", "host_policy", "rate_limiter")


def _signature(group: dict) -> tuple:
    """What Triton compares to tell two instances apart (a group with name and count ignored)."""
    return tuple(repr(group.get(key)) for key in _COMPARED)


def instance_names(group: dict) -> list[str]:
    """The instances Triton names for a group: `<group name>_<k>`."""
    return [f"{group['name']}_{k}" for k in range(int(group.get("count", 1)))]


def addressable(config: dict) -> bool:
    """Every instance of the model can be replaced alone: one instance per group, no two groups alike."""
    groups = config.get("instance_group") or []
    signatures = [_signature(g) for g in groups]
    return bool(groups) and all(int(g.get("count", 1)) == 1 for g in groups) and len(set(signatures)) == len(groups)


def group_of(config: dict, instance: str) -> dict | None:
    """The group whose instance `instance` is (None when the loaded config has no such instance)."""
    return next((g for g in config.get("instance_group") or [] if instance in instance_names(g)), None)


def _fresh(group: dict, taken: set[str]) -> dict:
    """A new group like `group` whose name and host policy no instance ever had: Triton creates a new instance."""
    match = _GENERATION.match(group["name"])
    base, n = (match["base"], int(match["n"])) if match else (group["name"], 0)
    name = f"{base}_r{n + 1}"
    while name in taken:
        n += 1
        name = f"{base}_r{n + 1}"
    fresh = copy.deepcopy(group)
    fresh.update(name=name, count=1, host_policy=name)
    return fresh


def with_groups(config: dict, groups: list[dict]) -> dict:
    """`config` with these instance groups (everything else unchanged: Triton then updates in place)."""
    updated = copy.deepcopy(config)
    updated["instance_group"] = groups
    return updated


def replacement(config: dict, instances: set[str]) -> tuple[dict | None, dict]:
    """The two configs that replace `instances` of an addressable model: first without them (None when no other
    instance would be left: a model keeps at least one), so that they take no more requests while the others serve;
    then with a fresh group for each."""
    groups = config.get("instance_group") or []
    leaving = [g for g in groups if set(instance_names(g)) & instances]
    staying = [g for g in groups if g not in leaving]
    taken = {g["name"] for g in groups}
    fresh = []
    for group in leaving:
        fresh.append(_fresh(group, taken))
        taken.add(fresh[-1]["name"])
    first = with_groups(config, staying) if staying else None
    return first, with_groups(config, staying + fresh)
