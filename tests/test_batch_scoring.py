"""`aot infer --input` as a nightly batch job against a real `aot serve` (issue 54): a server stopped (SIGTERM) and
started again mid-run loses, duplicates and changes no line; one never started again fails the lines left, exit 2,
and the summary says how many and why; a rate-limited server answers every line; a client killed halfway goes on with
--resume and every line is answered exactly once. The stop is triggered by progress (lines written), never by time:
the client sends one line a request so that the run is still under way when it comes. Figures (9,000 lines, the
rate limit's time, throughput against the old client): docs/benchmarks.md, "Batch scoring"."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from aot.local.server import free_ports
from aot.training.predict import Predictor
from tests.helpers import make_repository, train_tiny_task
from tests.tiny import write_sentiment_folder

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["good", "bad", "w1", "w2", "w3", "fine", "awful", "great", "dull", "superb"]
TEXTS = [" ".join(WORDS[(k * 7 + j * 3) % len(WORDS)] for j in range(2 + k % 5)) for k in range(40)]
LINES = 2000  # one line a request: a few seconds of work, so that a stop triggered at LINES // 5 comes mid-run


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_models, sentiment_dir):
    """A repository serving `sent` and a task trained on text pairs, `pairs` (the first by name: `aot serve`'s hint
    names it); `sent`'s PyTorch logits of TEXTS."""
    root = tmp_path_factory.mktemp("batch")
    artifact = train_tiny_task(tiny_models["bert"], sentiment_dir, root / "task")
    pairs = train_tiny_task(tiny_models["bert"], write_sentiment_folder(root / "pair-data", pair=True), root / "pairs",
                            epochs=1)
    make_repository(tiny_models["bert"], root / "repo", {"sent": (artifact, "factored"), "pairs": (pairs, "factored")})
    return root / "repo", Predictor.load(artifact).logits(TEXTS).numpy()


def _requests(folder: Path, count: int) -> Path:
    path = folder / "requests.jsonl"
    path.write_text("".join(json.dumps({"id": k, "task": "sent", "text": TEXTS[k % len(TEXTS)]}) + "\n"
                            for k in range(count)))
    return path


def _serve(repo: Path, ports: list[int], *extra: str) -> subprocess.Popen:
    """`aot serve` on fixed ports (a restart takes the same), ready when it printed its JSON line; its "next:" hint
    in `hint` (it writes a few lines more on stderr: the pipe holds them)."""
    process = subprocess.Popen([sys.executable, "-m", "aot", "serve", "--repo", str(repo), "--drain-seconds", "0",
                                *(f"--{name}-port={port}" for name, port in zip(("http", "grpc", "metrics", "health"),
                                                                                 ports, strict=True)), *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               start_new_session=True)
    assert process.stdout.readline(), process.stderr.read()
    while not (line := process.stderr.readline()).startswith("aot: next: "):
        assert line, "aot serve gave no hint"
    process.hint = line.removeprefix("aot: next: ").strip()
    return process


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0


def _infer(ports: list[int], requests: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "aot", "infer", "--url", f"127.0.0.1:{ports[1]}", "--input",
                             str(requests), "--output", str(out), "--no-progress", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _written(out: Path) -> int:
    return out.read_bytes().count(b"\n") if out.exists() else 0


def _wait_for_lines(out: Path, count: int, client: subprocess.Popen) -> None:
    """Until `count` lines are written (progress, not time); the client must still be running."""
    deadline = time.monotonic() + 300
    while _written(out) < count:
        assert client.poll() is None, client.stderr.read()
        assert time.monotonic() < deadline, f"{_written(out)} lines written in 300 s"
        time.sleep(0.01)


def _answers(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def _check_answered(answers: list[dict], logits: np.ndarray, ids: list[int]) -> None:
    """Each line answered once, in the order given, with PyTorch's logits (0 lost, 0 duplicated, 0 wrong)."""
    assert [a["id"] for a in answers] == ids
    failed = [a for a in answers if "error" in a]
    assert not failed, failed[:3]
    _check_logits(answers, logits)


def _check_logits(answers: list[dict], logits: np.ndarray) -> None:
    got = np.array([a["logits"] for a in answers])
    np.testing.assert_allclose(got, logits[[a["id"] % len(TEXTS) for a in answers]], atol=1e-3)


def test_a_server_stopped_and_started_again_mid_run_loses_no_line(repo, tmp_path):
    repo, logits = repo
    ports = free_ports(4)
    out = tmp_path / "answers.jsonl"
    server = _serve(repo, ports)
    try:
        client = _infer(ports, _requests(tmp_path, LINES), out, "--concurrency", "2", "--pack", "1",
                        "--retry-seconds", "300")
        _wait_for_lines(out, LINES // 5, client)
        _stop(server)  # SIGTERM: a graceful stop (no drain here), CANCELLED and "Server is stopping" on the way
        assert _written(out) < LINES  # the stop came mid-run: the lines left need the server started again
        server = _serve(repo, ports)
        _, err = client.communicate(timeout=600)
        assert client.returncode == 0, err
    finally:
        _stop(server)
    _check_answered(_answers(out), logits, list(range(LINES)))
    assert re.search(rf"^aot: {LINES} of {LINES} lines answered, 0 failed, [1-9][0-9]* retried, ", err, re.M), err


def test_a_server_never_started_again_fails_the_lines_left_and_says_why(repo, tmp_path):
    repo, logits = repo
    ports = free_ports(4)
    out = tmp_path / "answers.jsonl"
    server = _serve(repo, ports)
    try:
        client = _infer(ports, _requests(tmp_path, LINES), out, "--concurrency", "2", "--pack", "1",
                        "--retry-seconds", "3")
        _wait_for_lines(out, LINES // 5, client)
    finally:
        _stop(server)
    _, err = client.communicate(timeout=600)
    assert client.returncode == 2, err
    answers = _answers(out)
    assert [a["id"] for a in answers] == list(range(LINES))
    answered = [a for a in answers if "error" not in a]
    failed = [a for a in answers if "error" in a]
    assert len(answered) >= LINES // 5 and failed
    _check_logits(answered, logits)
    for answer in failed:
        assert answer["error_type"] == "Unavailable" and answer["retryable"] is True, answer
        assert answer["error"].endswith("(given up: no answer within the retry window of 3 s)"), answer
    assert f"aot: waiting for the server at 127.0.0.1:{ports[1]}: " in err
    assert re.search(rf"^aot: error: {len(answered)} of {LINES} lines answered, {len(failed)} failed \({len(failed)} "
                     rf"Unavailable, first line {failed[0]['id'] + 1}: .* \(given up: no answer within the retry window "
                     r"of 3 s\)\), [0-9]+ retried, .* lines/s; --resume --output .* sends only what is not answered yet$",
                     err, re.M), err


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{"))


def test_a_rate_limited_server_answers_every_line_paced(repo, tmp_path):
    """600 lines at `aot serve --rate-limit 100`: every line answered, in order, exit 0; the client honours the
    server's retry hints (the refusals are a few dozen: each is followed by the wait the server asked for), where
    it used to answer most lines with the refusal."""
    repo, logits = repo
    ports = free_ports(4)
    out = tmp_path / "answers.jsonl"
    server = _serve(repo, ports, "--rate-limit", "100")
    try:
        run = subprocess.run([sys.executable, "-m", "aot", "infer", "--url", f"127.0.0.1:{ports[1]}", "--input",
                              str(_requests(tmp_path, 600)), "--output", str(out), "--no-progress"],
                             capture_output=True, text=True, cwd=ROOT, timeout=600)
        time.sleep(1.5)  # the steps publish their counts at most every second
        refused = _metric(ports[2], "aot_rate_limited_total")
    finally:
        _stop(server)
    assert run.returncode == 0, run.stderr
    _check_answered(_answers(out), logits, list(range(600)))
    assert "asks to send later (rate limit: requests without a tenant key send at most 100 texts per second" in run.stderr
    assert re.search(r"^aot: 600 of 600 lines answered, 0 failed, [1-9][0-9]* retried, ", run.stderr, re.M)
    assert 0 < refused < 300, refused


def test_a_client_killed_halfway_goes_on_with_resume(repo, tmp_path):
    """SIGKILL of `aot infer` halfway: the file holds whole lines, in order; `--resume` sends only the lines it does
    not answer, and every line is then answered exactly once. (And `aot serve`'s hint, for a task trained on text
    pairs, is a call that works: issue 54.7.)"""
    repo, logits = repo
    ports = free_ports(4)
    out = tmp_path / "answers.jsonl"
    requests = _requests(tmp_path, LINES)
    server = _serve(repo, ports)
    try:
        assert server.hint == (f'aot infer --url 127.0.0.1:{ports[1]} --task pairs --pair "a second text" '
                               '"some text"')
        hinted = subprocess.run([sys.executable, "-m", *shlex.split(server.hint)], capture_output=True, text=True,
                                cwd=ROOT, timeout=120)
        assert hinted.returncode == 0 and json.loads(hinted.stdout)["version"].startswith("pairs@"), hinted.stderr
        client = _infer(ports, requests, out, "--concurrency", "1", "--pack", "1")
        _wait_for_lines(out, LINES // 4, client)
        client.kill()
        assert client.wait(60) == -signal.SIGKILL
        first = _answers(out)  # every line whole: json.loads would fail on half of one
        assert LINES // 4 <= len(first) < LINES
        _check_answered(first, logits, list(range(len(first))))
        resumed = subprocess.run([sys.executable, "-m", "aot", "infer", "--url", f"127.0.0.1:{ports[1]}", "--input",
                                  str(requests), "--output", str(out), "--no-progress", "--resume"],
                                 capture_output=True, text=True, cwd=ROOT, timeout=600)
    finally:
        _stop(server)
    assert resumed.returncode == 0, resumed.stderr
    _check_answered(_answers(out), logits, list(range(LINES)))
    assert re.search(rf"^aot: {LINES - len(first)} of {LINES - len(first)} lines answered \({len(first)} answered "
                     r"before in .*, skipped\), 0 failed, ", resumed.stderr, re.M), resumed.stderr
