"""The one reader of the project's versioned JSON files (task artifact, repository record, task store).

Every format carries `format` and `format_version`; a reader names the file and what is wrong with it: missing,
not JSON, another format or version, a missing key or a value of the wrong type. No schema library: the checks are
a dict of required keys and types per format, shorter than a JSON Schema and with messages that name the file.
"""

from __future__ import annotations

import json
from pathlib import Path


class FormatError(ValueError):
    """A file that is missing, not JSON, or not the expected format and version."""


def _type_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({dict: "object", list: "list", str: "string", int: "integer", float: "number",
                        bool: "boolean", type(None): "null"}.get(k, k.__name__) for k in kinds)


def check_keys(data: dict, required: dict, where: str) -> dict:
    """`required`: key -> type (or tuple of types). Raises FormatError naming `where` and the key."""
    for key, kind in required.items():
        if key not in data:
            raise FormatError(f"{where}: missing key {key!r}")
        value = data[key]
        if isinstance(value, bool) and kind in (int, float):
            raise FormatError(f"{where}: {key!r} must be {_type_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise FormatError(f"{where}: {key!r} must be {_type_name(kind)}, got {type(value).__name__}")
    return data


def read_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_versioned_json(path: str | Path, fmt: str, version: int, required: dict | None = None) -> dict:
    """Read a `fmt` v`version` file and check its required keys."""
    data = read_json(path)
    if data.get("format") != fmt or data.get("format_version") != version:
        raise FormatError(f"{path}: not an {fmt} v{version} file (format {data.get('format')!r}, "
                          f"version {data.get('format_version')!r})")
    return check_keys(data, required or {}, str(path))
