"""The task names of an index by tenant, each group sorted: what an unknown task's answer suggests from, at a cost
that does not grow with the number of tasks (one whole-index sort when the index is read, a bisect per changed name).

A caller may call the public tasks (unless keys are required and it has none) and its own tenant's
(aot.serving.store.tenants): the suggestions come from those two groups only, so an answer says nothing of other
tenants, not even how many tasks they hold.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator

from aot.serving.store.tenants import tenant_of

PUBLIC = ""  # the group of tasks without a tenant
MANY_CHANGES = 256  # more changed names in one group than this: the group is merged and sorted again, not bisected


class TaskNames:
    """Sorted names per tenant (PUBLIC: tasks without one). Never changed in place: `changed` returns a new one that
    shares the groups no change touched, so a thread reading the old one meanwhile sees one generation whole."""

    def __init__(self, groups: dict[str, list[str]] | None = None):
        self._groups = groups or {}

    @classmethod
    def of(cls, names: Iterable[str]) -> TaskNames:
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(tenant_of(name) or PUBLIC, []).append(name)
        for group in groups.values():
            group.sort()
        return cls(groups)

    def changed(self, names: Iterable[str], present: Callable[[str], bool]) -> TaskNames:
        """The names after a change of `names` (each in the index now when `present` says so): a bisect per name
        for a few, a merge and one sort of the group for many (100,000 inserts into a list of 100,000 move it
        100,000 times)."""
        touched: dict[str, list[str]] = {}
        for name in names:
            touched.setdefault(tenant_of(name) or PUBLIC, []).append(name)
        groups = dict(self._groups)
        for tenant, changed in touched.items():
            group = groups.get(tenant, [])
            if len(changed) > MANY_CHANGES:  # a merge in Python steps: no single call holds the interpreter long
                gone = set(changed)
                kept = (n for n in group if n not in gone)
                groups[tenant] = list(heapq.merge(kept, sorted(n for n in gone if present(n))))
                continue
            group = list(group)
            for name in changed:
                i = bisect.bisect_left(group, name)
                there = i < len(group) and group[i] == name
                if present(name) and not there:
                    group.insert(i, name)
                elif not present(name) and there:
                    del group[i]
            groups[tenant] = group
        return TaskNames({t: g for t, g in groups.items() if g})

    def visible(self, tenant: str | None, public: bool) -> tuple[Iterator[str], int]:
        """The names a caller may call, in order, and how many there are: its tenant's (None: none) and the public
        ones when `public`."""
        groups = ([self._groups.get(PUBLIC, [])] if public else []) + \
            ([self._groups.get(tenant, [])] if tenant is not None else [])
        return heapq.merge(*groups), sum(len(g) for g in groups)

    def first(self, tenant: str | None, public: bool, count: int, keep: Callable[[str], bool],
              scan: int) -> tuple[list[str], int]:
        """Up to `count` of the names a caller may call that `keep` accepts, in order, looking at `scan` names at
        most; and how many names the caller may call in all."""
        names, total = self.visible(tenant, public)
        return list(itertools.islice(filter(keep, itertools.islice(names, scan)), count)), total
