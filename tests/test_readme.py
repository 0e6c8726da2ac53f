"""Every code block of README.md and docs/getting-started.md runs as written (bash blocks line by line, python
blocks whole).

Against a tiny setup, so that it takes seconds: `minilm` stands for a tiny random BERT folder and `rotten_tomatoes`
for a tiny sentiment folder (the real ones take minutes: tests/test_demo_end_to_end.py runs them), and `aot serve`
is given free ports, which the commands after it learn from AOT_URL (so another server on 8001 does not matter). A
block right after `<!-- readme-test: skip: REASON -->` is not run, and the reason says why. A plain `aot` command (no
pipe, redirect or shell syntax) runs through `aot.cli.main.main` in this process, as the `aot` script would run it:
as a process of its own each would spend seconds importing torch and transformers; the others run through bash.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/getting-started.md")
BLOCK = re.compile(r"(?:<!-- readme-test: skip: (?P<skip>[^\n]*?) -->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```",
                   re.S | re.M)


@dataclass(frozen=True)
class Block:
    """A fenced block of a document."""

    lang: str
    code: str
    skip: str | None  # why it is not run (None: it runs)


def blocks(document: str) -> list[Block]:
    """Every fenced block of `document`."""
    text = (ROOT / document).read_text(encoding="utf-8")
    return [Block(m["lang"], m["code"], m["skip"]) for m in BLOCK.finditer(text)]


SHELL = re.compile(r"[|<>&;$`*?]")  # what needs a shell: pipes, redirects, lists, expansions


def run_in_process(argv: list[str]) -> tuple[int, str]:
    """`aot ARGV` through the console script's function: its exit status and what it wrote to standard error."""
    from aot.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own exits
            status = exc.code if isinstance(exc.code, int) else 1
    return status, err.getvalue()


def commands(code: str) -> list[str]:
    """The commands of a shell block: one a line, `\\` continues a line, comment lines skipped."""
    joined = code.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_block_runs_or_says_why(document):
    found = blocks(document)
    assert len(found) >= 5
    for block in found:
        assert block.lang in ("bash", "python", "text"), \
            f"{document}: a block without a known language: {block.code[:60]!r}"
        assert block.skip is None or block.skip.strip(), \
            f"{document}: a skipped block must say why: {block.code[:60]!r}"
    assert sum(block.skip is None and block.lang != "text" for block in found) >= 4


@pytest.mark.server
@pytest.mark.parametrize("document", DOCUMENTS)
def test_blocks_run(tmp_path, tiny_models, sentiment_dir, document, monkeypatch):
    from aot.local.server import free_port

    ports = {flag: free_port() for flag in ("--grpc-port", "--http-port", "--metrics-port", "--health-port")}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "AOT_URL": f"127.0.0.1:{ports['--grpc-port']}", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    stand_ins = {"minilm": str(tiny_models["bert"]), "rotten_tomatoes": str(sentiment_dir)}

    def tiny(command: str) -> str:
        return re.sub(r"\b(minilm|rotten_tomatoes)\b", lambda m: stand_ins[m[1]], command)

    server = None
    try:
        for block in blocks(document):
            if block.skip is not None or block.lang == "text":
                continue
            if block.lang == "python":
                run = subprocess.run([sys.executable, "-c", tiny(block.code)], cwd=tmp_path, env=env,
                                     capture_output=True, text=True, timeout=300)
                assert run.returncode == 0, f"{document}: {block.code}\n{run.stderr}"
                continue
            for command in commands(block.code):
                if command.startswith("aot serve"):
                    argv = shlex.split(tiny(command), comments=True) + [str(v) for kv in ports.items() for v in kv]
                    server = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True)
                    endpoints = json.loads(server.stdout.readline())  # printed once it is ready
                    continue
                if command.startswith("aot ") and not SHELL.search(command.split("#")[0]):
                    with monkeypatch.context() as m:
                        m.chdir(tmp_path)
                        for key in ("AOT_URL", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
                            m.setenv(key, env[key])
                        status, err = run_in_process(shlex.split(tiny(command), comments=True)[1:])
                    assert status == 0, f"{document}: {command}\n{err}"
                    continue
                run = subprocess.run(["bash", "-c", tiny(command)], cwd=tmp_path, env=env, capture_output=True,
                                     text=True, timeout=300)
                assert run.returncode == 0, f"{document}: {command}\n{run.stderr}"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    if server is not None:  # it says that it stopped, and leaves no temporary folder behind
        assert server.stderr.read().splitlines()[-1] == "aot: stopped serving runs/repo"
        assert not Path(endpoints["log"]).parent.exists()
