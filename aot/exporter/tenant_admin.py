"""`aot export tenant create | rotate | delete`: the tenants of a task store (aot.serving.store.tenants).

A tenant is one entry of the store's index: its name and the sha256 of its key. create and rotate make a new random
key and return it: it is shown once and stored nowhere (a lost key is replaced with rotate, which stops the old one
from the servers' next batch). delete removes the tenant and every task of it in one change of the index, so no
task of a tenant outlives it (their versions are retired as a removed task's are).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aot.exporter.entry_history import expired, retire_all
from aot.exporter.task_store import TaskStore
from aot.serving.store.log import Change, StoreState
from aot.serving.store.reader import check_tenant_name
from aot.serving.store.tenants import key_digest, new_key, tenant_of


@dataclass
class TenantChange:
    """What a tenant command did: the tenant, its new key (create, rotate) and the tasks a delete removed."""

    tenant: str
    key: str | None = None
    removed_tasks: list[str] = field(default_factory=list)


def _record(key: str) -> dict:
    return {"key_sha256": key_digest(key), "time": time.time()}


def create_tenant(store: TaskStore, tenant: str) -> TenantChange:
    check_tenant_name(tenant)
    key = new_key()

    def change(state: StoreState) -> Change:
        if tenant in state.tenants:
            raise ValueError(f"tenant {tenant!r} already exists in {store.location}: `aot export tenant rotate "
                             f"{tenant}` gives it a new key")
        return Change(tenants={tenant: _record(key)})

    store.commit(change)
    return TenantChange(tenant, key)


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
        retired = {}
        for name in mine:
            retired.update(retire_all(state.tasks[name]))
        return Change(tasks={n: None for n in mine}, retired={**retired, **expired(state)},
                      tenants={tenant: None})

    store.commit(change)
    return TenantChange(tenant, removed_tasks=removed)


def _check_exists(store: TaskStore, state: StoreState, tenant: str) -> None:
    if tenant not in state.tenants:
        known = ", ".join(sorted(state.tenants)[:10]) or "(none)"
        raise ValueError(f"no tenant {tenant!r} in {store.location}; tenants: {known}")
