"""Argument types shared by the `aot` subcommands: a bad value is named in argparse's one-line error."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable


class HelpFormatter(argparse.HelpFormatter):
    """Each option's default said once, where it says something: not for a switch or a None default, nor when the
    help already says it (`default: the method's`); a list as it is typed (comma-separated)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default:" in text.lower() or action.nargs == 0
                or any(default is nothing for nothing in (None, False, argparse.SUPPRESS))):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """The `aot` parsers: every one, subcommands included, formats its help with HelpFormatter. `populate`: a function
    that adds the parser's arguments when the parser is first used (to parse, or to show its help), not when it is
    made: a subcommand whose arguments need heavy imports (`aot train`'s methods: torch) costs nothing to the other
    commands, which build every subcommand's parser to list them."""

    def __init__(self, *args, populate: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _populated(self) -> None:
        populate, self._populate = self._populate, None
        if populate is not None:
            populate(self)

    def parse_known_args(self, args=None, namespace=None):
        self._populated()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._populated()
        return super().format_help()

    def format_usage(self) -> str:
        self._populated()
        return super().format_usage()


def add_command_group(sub, name: str, **kwargs) -> argparse._SubParsersAction:
    """A command whose first argument names one of its own subcommands (`aot export WHAT`, `aot bench WHAT`): its
    parser made with `kwargs` (help, description), and the subparsers that its subcommands are added to."""
    return sub.add_parser(name, **kwargs).add_subparsers(dest=f"{name}_command", required=True, metavar="WHAT")


def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
        return value

    return parse


positive_int = _int_at_least(1, "positive")
non_negative_int = _int_at_least(0, "non-negative")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value}")
    return value


def ints(text: str) -> list[int]:
    """Comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def names(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag for each field of the dataclass `cls` whose metadata names one (`flag`, `help`, and `minimum` or
    `choices`), with the field's default: the options class stays the one source of names, defaults and limits.
    The parsed value lands under the field's name; a tuple of integers is read as comma-separated integers."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "flag" not in meta:
            continue
        default = f.default
        kwargs = {"dest": f.name, "default": default, "help": meta["help"],
                  "metavar": meta["flag"].lstrip("-").upper().replace("-", "_")}
        if "choices" in meta:
            del kwargs["metavar"]  # argparse lists the choices instead
            kwargs["choices"] = list(meta["choices"])
        elif isinstance(default, tuple):
            kwargs["type"] = ints
            kwargs["default"] = list(default)
        else:
            kwargs["type"] = _int_at_least(meta["minimum"], "positive" if meta["minimum"] else "non-negative")
        parser.add_argument(meta["flag"], **kwargs)


def dataclass_from_arguments(cls, args: argparse.Namespace):
    """The dataclass `cls` built from what add_dataclass_arguments parsed (fields without a flag keep defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if "flag" in f.metadata})
