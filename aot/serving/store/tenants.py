"""Tenants: task namespaces `TENANT/TASK` that answer only requests carrying the tenant's key.

A tenant is an entry of the task store's index (docs/formats.md): its name and the sha256 of its key, never the key
(`aot export tenant create` prints the key once). A request carries the key as the request parameter
TENANT_KEY_PARAMETER. Who may call what:
    TENANT/TASK   only a request with TENANT's key;
    TASK          any request, or with `aot serve --require-tenant-keys` (AOT_REQUIRE_TENANT_KEYS) only one with a valid
                  key of some tenant.
A task the caller may not call is answered exactly as a task that does not exist (aot.serving.task_registry), and only
tasks the caller may call are suggested or listed: a caller learns nothing of other tenants. Keys are random
(KEY_BYTES of entropy), so a plain sha256 stands in for them; digests are compared with hmac.compare_digest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from aot import settings

TENANT_KEY_PARAMETER = "aot-tenant-key"
KEY_PREFIX = "aotk_"
KEY_BYTES = 32
SEPARATOR = "/"


def tenant_of(name: str) -> str | None:
    """The tenant of a task name or version (`acme/intent`, `acme/intent@<id>` -> acme), None for a public task."""
    head, sep, _ = name.partition(SEPARATOR)
    return head if sep else None


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def require_tenant_keys(environ: Mapping[str, str] | None = None) -> bool:
    return settings.REQUIRE_TENANT_KEYS.read(environ)


def key_of_parameters(parameters: str) -> str | None:
    """The tenant key among a request's parameters (a JSON object, as the python backend gives them), or None."""
    if not parameters:
        return None
    try:
        value = json.loads(parameters).get(TENANT_KEY_PARAMETER)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as far as tasks are concerned: the tenant whose key it carries (None: no valid key)."""

    tenant: str | None = None

    @classmethod
    def of(cls, key: str | None, tenants: Mapping[str, str]) -> "Caller":
        """The tenant whose key digest (`tenants`: tenant -> digest) matches `key`: every digest compared in constant
        time, so the time taken does not say how close a guess came."""
        if not key:
            return cls()
        digest = key_digest(key)
        found = None
        for tenant, stored in tenants.items():
            if hmac.compare_digest(digest, stored):
                found = tenant
        return cls(found)

    def may_call(self, name: str, require_keys: bool) -> bool:
        """Whether this caller may call task (or version) `name`."""
        owner = tenant_of(name)
        if owner is None:
            return self.tenant is not None or not require_keys
        return owner == self.tenant


def may_call(name: str, key: str | None, tenants: Mapping[str, str], require_keys: bool) -> bool:
    """Caller.of(key, tenants).may_call(name), comparing one digest only when `name` is a tenant's task."""
    owner = tenant_of(name)
    if owner is None:
        return not require_keys or Caller.of(key, tenants).tenant is not None
    stored = tenants.get(owner)
    return bool(key) and stored is not None and hmac.compare_digest(key_digest(key), stored)
