"""`aot export tenant create | rotate | delete | list`: the tenants of a task store (aot.serving.store.tenants).

A tenant is one entry of the store's index: its name and the sha256 of its key. create and rotate make a new random
key and return it: it is shown once and stored nowhere (a lost key is replaced with rotate, which stops the old one
from the servers' next batch). create takes many tenants in one change of the index (all of them or none). delete
removes the tenant and every task of it in one change of the index, so no task of a tenant outlives it, and its
versions are dropped at once rather than retired with a grace: with the tenant gone no key may call them anyway, and a
tenant created again under the same name must not answer its predecessor's pinned versions (`TENANT/TASK@ID`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aot.serving.formats import iso_time
from aot.serving.store.entry_history import expired, held_versions
from aot.serving.store.log import Change, StoreState
from aot.serving.store.reader import check_tenant_name
from aot.serving.store.tenants import key_digest, new_key, tenant_of
from aot.serving.store.writer import TaskStore


@dataclass
class TenantChange:
    """What a tenant command did: the tenant, its new key (create, rotate) and the tasks a delete removed."""

    tenant: str
    key: str | None = None
    removed_tasks: list[str] = field(default_factory=list)


def _record(key: str) -> dict:
    return {"key_sha256": key_digest(key), "time": time.time()}


def create_tenants(store: TaskStore, tenants: list[str]) -> list[TenantChange]:
    """Tenants created in one change of the index, each with a new key: all of them, or (a bad or taken name) none."""
    for tenant in tenants:
        check_tenant_name(tenant)
    repeated = sorted({t for t in tenants if tenants.count(t) > 1})
    if repeated:
        raise ValueError(f"tenant(s) given twice: {', '.join(repeated)}")
    keys = {tenant: new_key() for tenant in tenants}

    def change(state: StoreState) -> Change:
        taken = [t for t in tenants if t in state.tenants]
        if taken:
            raise ValueError(f"tenant(s) {', '.join(map(repr, taken))} already exist in {store.location}: nothing was "
                             f"created (`aot export tenant rotate {taken[0]}` gives one a new key)")
        return Change(tenants={tenant: _record(key) for tenant, key in keys.items()})

    store.commit(change)
    return [TenantChange(tenant, key) for tenant, key in keys.items()]


def rotate_tenant(store: TaskStore, tenant: str) -> TenantChange:
    check_tenant_name(tenant)
    key = new_key()

    def change(state: StoreState) -> Change:
        _check_exists(store, state, tenant)
        return Change(tenants={tenant: _record(key)})

    store.commit(change)
    return TenantChange(tenant, key)


def delete_tenant(store: TaskStore, tenant: str) -> TenantChange:
    check_tenant_name(tenant)
    removed: list[str] = []

    def change(state: StoreState) -> Change:
        _check_exists(store, state, tenant)
        mine = sorted(n for n in state.tasks if tenant_of(n) == tenant)
        removed[:] = mine
        gone = {v: None for name in mine for v in held_versions(state.tasks[name])}  # dropped at once, not retired
        gone.update({v: None for v in state.retired if tenant_of(v) == tenant})  # nor those retired before
        return Change(tasks={n: None for n in mine}, retired={**expired(state), **gone}, tenants={tenant: None})

    store.commit(change)
    return TenantChange(tenant, removed_tasks=removed)


def _check_exists(store: TaskStore, state: StoreState, tenant: str) -> None:
    if tenant not in state.tenants:
        known = ", ".join(sorted(state.tenants)[:10]) or "(none)"
        raise ValueError(f"no tenant {tenant!r} in {store.location}; tenants: {known}")


def list_tenants(store: TaskStore) -> list[dict]:
    """Every tenant, by name: since when its key is valid (ISO 8601 UTC) and how many tasks it has."""
    state = store.state()
    tasks: dict[str, int] = {}
    for name in state.tasks:
        if (owner := tenant_of(name)) is not None:
            tasks[owner] = tasks.get(owner, 0) + 1
    return [{"tenant": tenant, "key_since": iso_time(record.get("time")), "tasks": tasks.get(tenant, 0)}
            for tenant, record in sorted(state.tenants.items())]
