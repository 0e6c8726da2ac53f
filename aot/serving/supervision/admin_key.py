"""The deployment's admin key: the control API of tritonserver is closed to clients.

tritonserver runs with --http-restricted-api / --grpc-restricted-protocol on every API a client does not need
(restriction_args), and only a request carrying the admin key (header ADMIN_HEADER) may use them: the supervisor's
reloads, an operator's calls. The key comes from AOT_ADMIN_KEY or the file AOT_ADMIN_KEY_FILE names (a Docker or
Kubernetes secret), else it is generated; it is never logged (docs/security.md)."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from aot import settings

# The control API: every API a client does not need is restricted to the admin key. Public: health, metadata
# and inference. shared-memory is restricted too: registering a region by name lets a client make the server
# read or write any /dev/shm region it can open, the python stubs' own included (a crash or a leak), and clients
# on other hosts cannot use shared memory anyway.
ADMIN_HEADER = "aot-admin-key"  # the HTTP header; gRPC metadata carries it as GRPC_ADMIN_HEADER (Triton's prefix)
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
RESTRICTED_APIS = ("model-repository", "model-config", "shared-memory", "statistics", "trace", "logging")
PUBLIC_APIS = ("health", "metadata", "inference")
_ADMIN_KEY = re.compile(r"[A-Za-z0-9_-]{16,256}")
RESTRICTION_FLAGS = ("--http-restricted-api", "--grpc-restricted-protocol")


class AdminKeyError(ValueError):
    pass


def check_admin_key(key: str, where: str) -> str:
    key = key.strip()
    if not _ADMIN_KEY.fullmatch(key):
        raise AdminKeyError(f"{where}: the admin key must be 16-256 letters, digits, '_' or '-' "
                            f"(got {len(key)} characters); e.g. python3 -c 'import secrets; "
                            "print(secrets.token_urlsafe(32))'")
    return key


def admin_key_from_environment(environ=None) -> str | None:
    """The deployment's admin key: AOT_ADMIN_KEY, or the file AOT_ADMIN_KEY_FILE names (a Docker or Kubernetes
    secret); None when neither is set."""
    key = settings.ADMIN_KEY.read(environ)
    if key:
        return check_admin_key(key, settings.ADMIN_KEY.name)
    file = settings.ADMIN_KEY_FILE.read(environ)
    if file:
        path = Path(file)
        try:
            return check_admin_key(path.read_text(), str(path))
        except OSError as exc:
            raise AdminKeyError(f"{settings.ADMIN_KEY_FILE.name}={path}: cannot read it: {exc.strerror}") from None
    return None


def generate_admin_key() -> str:
    return secrets.token_urlsafe(32)


def resolve_admin_key(key: str | None) -> str:
    """The key a server (or a fleet's servers) uses: `key` when given (checked), else the environment's, else a new
    one."""
    if key is not None:
        return check_admin_key(key, "admin key")
    return admin_key_from_environment() or generate_admin_key()


def restriction_args(key: str) -> list[str]:
    """tritonserver flags that restrict RESTRICTED_APIS over HTTP and gRPC to requests carrying the key."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"{flag}={apis}:{ADMIN_HEADER}={key}" for flag in RESTRICTION_FLAGS]
