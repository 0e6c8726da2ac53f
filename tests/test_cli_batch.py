"""`aot infer --input` as a batch job, what needs no server: the answers file (whole lines only, what --resume keeps
and drops: aot.cli.answer_file), the summary line and the exit code (aot.cli.batch_report). Through a real server
(a stopped, restarted, rate-limited one; a killed client resumed): tests/test_batch_scoring.py."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest

from aot.cli.answer_file import AnswerSink, read_answered
from aot.cli.batch_report import Tally
from aot.cli.main import main
from tests.helpers import one_line_error


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_keeps_answered_lines_and_drops_failed_and_torn_ones(tmp_path):
    """An answer is found by its id and task, or by its line number ("line") for a line without an id; lines
    answered with an error and an incomplete last line (a disk that filled up) are dropped from the file."""
    out = tmp_path / "answers.jsonl"
    out.write_text('{"id": 1, "task": "a", "label": "x"}\n'
                   '{"line": 2, "task": "a", "label": "y"}\n'
                   '{"id": "1", "task": "b", "label": "z"}\n'
                   '{"id": 4, "task": "a", "error": "no server", "error_type": "Unavailable"}\n'
                   '{"id": 5, "task": "a", "lab')
    resumed = read_answered(str(out))
    assert resumed.answered == {("id", "1", "a"), ("line", 2), ("id", '"1"', "b")}
    assert (resumed.failed, resumed.unreadable) == (1, 1)
    assert [a.get("id", a.get("line")) for a in _lines(out)] == [1, 2, "1"]
    assert read_answered(str(tmp_path / "none.jsonl")).answered == set()


def test_a_failed_write_leaves_whole_lines_only(tmp_path, monkeypatch):
    """A write the disk refuses halfway is cut back to the last whole line, and named."""
    out = tmp_path / "answers.jsonl"
    sink = AnswerSink(str(out))
    sink.write({"id": 1, "label": "x"})
    real_write = os.write

    def full(fd, data):
        real_write(fd, data[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match=f"cannot write {re.escape(str(out))}: No space left on device"):
        sink.write({"id": 2, "label": "y"})
    monkeypatch.setattr(os, "write", real_write)
    sink.close()
    assert _lines(out) == [{"id": 1, "label": "x"}]


def test_the_summary_counts_by_reason_and_the_exit_code_says_any_failed():
    tally = Tally(lines=5, skipped=1)
    tally.count(2, {"id": 2, "label": "x"})
    tally.count(3, {"line": 3, "error": "line 3: invalid JSON (Expecting value)", "error_type": "InvalidInput"})
    tally.count(4, {"id": 4, "error": "Server is stopping (given up: ...)", "error_type": "Unavailable"})
    tally.count(5, {"id": 5, "error": "failed to connect", "error_type": "Unavailable"})
    assert tally.exit_code(partial_ok=False) == 2 and tally.exit_code(partial_ok=True) == 0
    text = tally.summary(retried=7, code=2, output="out.jsonl")
    assert re.fullmatch(r"aot: error: 1 of 4 lines answered \(1 answered before in out\.jsonl, skipped\), 3 failed "
                        r"\(2 Unavailable, first line 4: Server is stopping \(given up: \.\.\.\); 1 InvalidInput, "
                        r"first line 3: invalid JSON \(Expecting value\)\), 7 retried, [0-9.]+ s, [0-9]+ lines/s; "
                        r"--resume --output out\.jsonl sends only what is not answered yet", text), text
    assert tally.summary(retried=7, code=0, output=None).startswith("aot: warning: 1 of 4 lines answered")
    none_failed = Tally(lines=2, skipped=0)
    none_failed.count(1, {"line": 1, "label": "x"})
    assert none_failed.exit_code(partial_ok=False) == 0
    assert re.fullmatch(r"aot: 1 of 2 lines answered, 0 failed, 0 retried, [0-9.]+ s, [0-9]+ lines/s",
                        none_failed.summary(0, 0, None))
    long = Tally(lines=1, skipped=0)
    message = "failed to connect to all addresses; " + "x" * 300 + " (given up: no answer within the retry window of 60 s)"
    long.count(1, {"line": 1, "error": message, "error_type": "Unavailable"})
    assert re.search(r"first line 1: failed to connect to all addresses; x+ \.\.\. \(given up: no answer within the "
                     r"retry window of 60 s\)\), 0 retried", long.summary(0, 2, None))  # cut in the middle: why stays
    every_failed = Tally(lines=1, skipped=0)
    every_failed.count(1, {"line": 1, "error": "x", "error_type": "InvalidInput"})
    assert every_failed.exit_code(partial_ok=True) == 2


def test_resume_sends_only_what_is_not_answered(tmp_path, capsys):
    """The answered lines are kept; a failed one is answered again (here a bad line: nothing needs the server, which
    is never reached); the summary says what was skipped and dropped."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"id": 1, "task": "a", "text": "x"}\nnot json\n{"id": 3, "task": "a", "text": "y"}\n')
    out = tmp_path / "answers.jsonl"
    out.write_text('{"id": 1, "task": "a", "label": "p"}\n{"line": 2, "error": "old", "error_type": "InvalidInput"}\n'
                   '{"id": 3, "task": "a", "label": "n"}\n')
    argv = ["infer", "--url", "127.0.0.1:9", "--input", str(requests), "--output", str(out), "--resume"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"aot: error: 0 of 1 lines answered \(2 answered before in .*answers\.jsonl, skipped\) "
                        r"\(dropped from .*: 1 failed line\(s\) sent again\), 1 failed \(1 InvalidInput, first line 2: "
                        r"invalid JSON \(Expecting value\)\), 0 retried, .*", err), err
    answers = _lines(out)
    assert [a.get("id", a.get("line")) for a in answers] == [1, 3, 2]
    assert answers[2]["error"].startswith("line 2: invalid JSON")


def test_resume_needs_an_output_and_ids_once_per_task(tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"id": 7, "task": "a", "text": "x"}\n{"id": 8, "task": "a", "text": "y"}\n'
                        '{"id": 7, "task": "b", "text": "x"}\n{"id": 7, "task": "a", "text": "z"}\n')
    assert main(["infer", "--input", str(requests), "--resume"]) == 2
    assert one_line_error(capsys) == ("aot: error: --resume needs --input and --output FILE (the answers so far are "
                                      "read from it)")
    assert main(["infer", "--input", str(requests), "--output", str(tmp_path / "o.jsonl"), "--resume"]) == 2
    assert one_line_error(capsys) == ("aot: error: --resume: id 7 of task 'a' is on lines 1 and 4: resuming needs "
                                      "each id once per task (or lines without ids, resumed by line number)")
