"""The method registry: a method name maps to its config class and a builder.

A builder takes the frozen backbone and the method's config and returns a *body*: a module that maps
(input_ids, attention_mask, token_type_ids) to the final hidden states [B, S, d] of the input's tokens. The task
head sits on top of any body (aot.training.model.TaskModel): a token task's reads every state, the others the states
pooled as their task pools them (aot.serving_torch.encoder.pool_states). Only the parameters a method makes trainable
have requires_grad.

Methods register on import: importing any module of `training` runs the package's __init__ first, which imports
aot.training.methods, and each method registers itself. So the registry is full for whoever imports it, and it imports
no method itself: the methods sit above it (and above aot.training.artifact, which reads their configs).
"""

from __future__ import annotations

import typing
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import ClassVar


class MethodError(ValueError):
    """A bad method name or hyperparameter."""


@dataclass
class MethodConfig:
    """Base of every method's hyperparameters. Subclasses document their fields."""

    method: ClassVar[str]
    # The hyperparameter that `aot train --rank` sets (rank, bottleneck size or prompt length), or None.
    rank_field: ClassVar[str | None] = None

    def to_json(self) -> dict:
        return {"method": self.method, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "MethodConfig":
        """Build from `to_json` output; unknown keys (a typo, a newer version's field) are warned about and skipped."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"method"})
        if unknown:
            warnings.warn(f"method {cls.method!r}: ignoring unknown config keys {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(known))})", UserWarning, stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in known})

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and f.name in ("rank", "length") and value < 1:
                raise MethodError(f"{self.method}: {f.name} must be a positive integer, got {value}")
            if f.name == "dropout" and not 0.0 <= float(value) < 1.0:
                raise MethodError(f"{self.method}: dropout must be in [0, 1), got {value}")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_cls: type[MethodConfig]
    build: Callable  # (Backbone, MethodConfig) -> nn.Module body
    description: str
    default_lr: float = 1e-3
    # True when tasks of this method run on the shared, unmodified backbone graph with per-token biases (AoT).
    shared_backbone: bool = False


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    METHODS[spec.name] = spec
    return spec


def method_spec(name: str) -> MethodSpec:
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r}: expected one of {', '.join(METHODS)}")
    return METHODS[name]


def option_types(name: str) -> dict[str, type]:
    """The hyperparameters `aot train --option NAME=VALUE` may set for a method, with their types: every config
    field but the rank-like one (that is --rank)."""
    cls = method_spec(name).config_cls
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if f.name != cls.rank_field}


def _convert(name: str, field: str, kind, text: str):
    """`text` as the field's type; an optional field also takes 'none'."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if args and type(None) in typing.get_args(kind):
        if text.strip().lower() == "none":
            return None
        kind = args[0]
    try:
        if kind is bool:
            return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[text.lower()]
        return kind(text)
    except (KeyError, ValueError):
        raise MethodError(f"{name}: option {field}={text!r}: expected {getattr(kind, '__name__', kind)}") from None


def parse_options(name: str, items: list[str]) -> dict:
    """`NAME=VALUE` strings as a method's config overrides, each value converted to its field's type."""
    types = option_types(name)
    options = {}
    for item in items:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or not field:
            raise MethodError(f"option {item!r}: expected NAME=VALUE")
        if field not in types:
            raise MethodError(_unknown_option(name, field))
        options[field] = _convert(name, field, types[field], text.strip())
    return options


def _unknown_option(name: str, field: str) -> str:
    cls = method_spec(name).config_cls
    known = ", ".join(option_types(name)) or "none"
    hint = " (set it with --rank)" if field == cls.rank_field else ""
    return f"{name}: unknown option {field!r}{hint}: expected one of: {known}"


def make_config(name: str, rank: int | None = None, **overrides) -> MethodConfig:
    """A method's default config with `overrides` (option_types' fields), `rank` mapped to its rank-like field."""
    spec = method_spec(name)
    known = option_types(name)
    for field in overrides:
        if field not in known:
            raise MethodError(_unknown_option(name, field))
    config = spec.config_cls(**overrides)
    if rank is not None:
        if spec.config_cls.rank_field is None:
            raise MethodError(f"method {name!r} has no rank; drop --rank")
        setattr(config, spec.config_cls.rank_field, rank)
    config.validate()
    return config

