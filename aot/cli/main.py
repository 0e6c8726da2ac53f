"""The `aot` command: train, predict, inspect, export, serve, infer, and commands of other packages (bench).

Each subcommand is a thin layer over the library. Results go to stdout as JSON lines, what people read to stderr
(aot.cli.output); bad input ends with one line `aot: error: ...` and exit code 2. Commands defined elsewhere are plugins
(entry-point group `aot.commands`): `aot` imports no package above it (`benchmarks` brings `bench`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from aot import settings
from aot.cli import export as export_cli
from aot.cli import infer as infer_cli
from aot.cli import serve as serve_cli
from aot.cli import task as task_cli
from aot.cli.arguments import Parser
from aot.cli.output import install_hint, missing_extra

# Packages whose warnings speak to the user (aot.training.data.DataWarning): printed as `aot: warning: ...`.
OWN_PACKAGES = ("training.", "exporter.", "serving.", "aot.")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings of this project print as one line like its errors; other libraries' as they would."""
    if category.__module__.startswith(OWN_PACKAGES):
        print(f"aot: warning: {message}", file=sys.stderr)
    else:
        _show_warning.library(message, category, filename, lineno, file, line)


# What quiets Hugging Face's libraries when they are imported later (transformers reads these at import): a command
# that needs no model (infer, tasks, export tenant, ...) must not import transformers only to quiet it.
QUIET_LIBRARIES = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
                   "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _quiet_libraries() -> None:
    for name, value in QUIET_LIBRARIES.items():
        os.environ.setdefault(name, value)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    if warnings.showwarning is not _show_warning:
        _show_warning.library = warnings.showwarning
        warnings.showwarning = _show_warning
    if "transformers" in sys.modules:  # imported already (aot train's parser, or a caller of main): its environment
        from transformers.utils import logging as hf_logging  # was read before this

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


# --- entry point ---------------------------------------------------------------------------------------------------

SUBCOMMANDS = (task_cli.add_train, task_cli.add_predict, task_cli.add_evaluate, task_cli.add_inspect,
               export_cli.add_export, serve_cli.add_serve,
               serve_cli.add_tasks, infer_cli.add_infer)

# Commands of other packages (plugins): each entry point of this group names a function that adds the command's
# parser(s) to aot's subparsers, each with set_defaults(run=...), as aot.cli.task's add_* functions do.
PLUGIN_GROUP = "aot.commands"
# The plugins this project ships, by command, and the extra that installs each: `aot --help` lists them, installed
# or not, and a missing one answers with what to install.
SHIPPED_PLUGINS = {"bench": "bench"}
# Plugins registered in code, which win over the installed entry points of the same name: a checkout run from
# PYTHONPATH has no entry points (`python -m aot.benchmarks`), nor has an install older than the plugin (the tests).
REGISTERED: dict[str, Callable] = {}


def add_plugins(sub) -> None:
    """The shipped plugins first (installed or not), then any other."""
    installed = {entry.name: entry for entry in entry_points(group=PLUGIN_GROUP)}
    for name in dict.fromkeys([*SHIPPED_PLUGINS, *installed, *REGISTERED]):
        add = REGISTERED.get(name)
        if add is None and name in installed:
            try:
                add = installed[name].load()
            except ImportError as exc:  # its metadata is installed, its module is gone
                _add_unavailable(sub, name, "its plugin does not load",
                                 lambda args, name=name, error=exc: _missing_plugin(name, error))
                continue
        if add is None:
            _add_unavailable(sub, name, f"not installed: the [{SHIPPED_PLUGINS[name]}] extra",
                             lambda args, name=name: _missing_plugin(name))
        else:
            add(sub)


def _add_unavailable(sub, name: str, summary: str, run: Callable) -> None:
    """A command that cannot run here: whatever it is given, it answers `run` (what to install)."""
    p = sub.add_parser(name, help=summary, prefix_chars="\0")
    p.add_argument("arguments", nargs="*")
    p.set_defaults(run=run)


def _missing_plugin(name: str, error: ImportError | None = None) -> int:
    """What to install (a shipped plugin), else why the plugin does not load."""
    if name in SHIPPED_PLUGINS:
        print(f"aot: error: the {name} command comes from a plugin that is not installed (entry point group "
              f"{PLUGIN_GROUP}): {install_hint(SHIPPED_PLUGINS[name])}", file=sys.stderr)
    else:
        print(f"aot: error: the plugin of the {name} command does not load: {error}", file=sys.stderr)
    return 2


ENVIRONMENT = ("Environment variables: AOT_URL, the server's gRPC address for aot infer, aot tasks and aot.Client "
               f"(else {settings.URL.default}); AOT_DEBUG=1, the full traceback of an error instead of its one line; "
               "AOT_STEP_PYTHON, the Python that runs the served steps of aot serve (docs/deploy-local.md).")


def build_parser() -> argparse.ArgumentParser:
    from aot import __version__

    parser = Parser(
        prog="aot", description="Ahead-of-Time P-Tuning: train tasks, export them to a Triton model repository, "
                                "serve many tasks on one backbone, and call them with a task id.", epilog=ENVIRONMENT)
    parser.add_argument("--version", action="version", version=f"aot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    add_plugins(sub)
    return parser


def _utf8_stdout() -> None:
    """JSON lines are UTF-8 text (RFC 8259), and answers print labels and texts as they are (`ensure_ascii=False`):
    standard output writes UTF-8 whatever the locale says."""
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    if encoding != "utf8" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    _utf8_stdout()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # `aot train`'s parser imports the training methods (Parser's populate)
    except ImportError as exc:
        if settings.DEBUG.read() or not exc.name:
            raise
        return missing_extra(exc)
    _quiet_libraries()
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("aot: interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:
        if settings.DEBUG.read() or not exc.name:
            raise
        return missing_extra(exc)
    except (ValueError, OSError, RuntimeError) as exc:
        if settings.DEBUG.read():
            raise
        for detail in getattr(exc, "details", ()):  # several bad rows (aot.training.data DataErrors): one line each
            print(f"aot: {' '.join(detail.split())}", file=sys.stderr)
        message = " ".join(str(getattr(exc, "summary", exc)).split()) or type(exc).__name__
        print(f"aot: error: {message}", file=sys.stderr)
        return 2

