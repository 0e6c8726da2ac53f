"""The `aot` CLI's help and conventions: every flag and argument says what it does and its one right default,
--version, and renamed flags keep their old spelling."""

from __future__ import annotations

import pytest

from aot.cli.main import main


def _parsers(parser=None, path="aot"):
    """Every (command path, parser) of `aot`, subcommands of subcommands included."""
    import argparse

    from aot.cli.main import build_parser

    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_flag_and_argument_has_help_and_one_right_default():
    import argparse

    for path, parser in _parsers():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"{path} {name} has no help"
            shown = parser._get_formatter()._get_help_string(action).lower()
            # once, where there is a value to say (None and switches may say theirs in words: "default: the method's")
            said = {0, 1} if action.default is None or action.nargs == 0 else {1}
            assert shown.count("default:") in (said if action.option_strings else {0}), f"{path} {name}: {shown}"
            assert "(default: none)" not in shown, f"{path} {name}: {shown}"
    train = dict(_parsers())["aot train"].format_help()
    assert "(default: 10)" in " ".join(train.split()).split("--epochs EPOCHS")[-1].split("--")[0]


def test_version(capsys):
    from aot import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"aot {__version__}\n"


def test_infer_calls_an_ensemble_and_keeps_the_old_flag():
    from aot.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["infer", "--ensemble", "vanilla", "x"]).ensemble == "vanilla"
    assert parser.parse_args(["infer", "--model", "vanilla", "x"]).ensemble == "vanilla"
    assert parser.parse_args(["infer", "x"]).ensemble == "aot"
    assert "--model" not in dict(_parsers(parser))["aot infer"].format_help()
