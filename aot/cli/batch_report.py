"""What `aot infer` says of its answers: the one-line summary of an --input run and its exit code (Tally), and
--top-k applied to answers as they stream (TopK)."""

from __future__ import annotations

import sys
import time
from collections import Counter

from aot.cli.answer_file import Resumed
from aot.cli.ranking import ServedLabels, top_labels, top_scores, unranked_note

SHOWN_ERROR = 160  # characters of a reason's first error the summary shows


class Tally:
    """The lines of an --input run as they are written: answered, failed by reason (the error's class, with the
    first line of each), since when; `lines` in the input, `skipped` answered before (--resume)."""

    def __init__(self, lines: int, skipped: int, resumed: Resumed | None = None):
        self.lines, self.skipped, self.resumed = lines, skipped, resumed
        self.answered = 0
        self.failed: Counter = Counter()
        self.first: dict[str, tuple[int, str]] = {}
        self.started = time.monotonic()
        self.interrupted = False

    def count(self, number: int, answer: dict) -> None:
        if "error" not in answer:
            self.answered += 1
            return
        reason = answer.get("error_type") or "InferenceError"
        self.failed[reason] += 1
        self.first.setdefault(reason, (number, str(answer["error"]).removeprefix(f"line {number}: ")))

    def exit_code(self, partial_ok: bool) -> int:
        """2 when any line failed (`partial_ok`: only when every line written failed), else 0."""
        if not self.failed or (partial_ok and self.answered):
            return 0
        return 2

    def summary(self, retried: int, code: int, output: str | None) -> str:
        """One line: `aot: A of N lines answered, F failed (by reason, each with its first line), R retried, T s,
        L lines/s`, prefixed `error:` when the exit code says the run failed, `warning:` when lines failed anyway."""
        seconds = time.monotonic() - self.started
        to_send = self.lines - self.skipped
        failed = sum(self.failed.values())
        text = f"{self.answered} of {to_send} lines answered"
        if self.skipped:
            text += f" ({self.skipped} answered before in {output}, skipped)"
        if self.resumed is not None and (self.resumed.failed or self.resumed.unreadable):
            text += (f" (dropped from {output}: {self.resumed.failed} failed line(s) sent again"
                     + (f", {self.resumed.unreadable} unreadable" if self.resumed.unreadable else "") + ")")
        text += f", {failed} failed"
        if failed:
            text += " (" + "; ".join(f"{n} {reason}, first line {self.first[reason][0]}: "
                                     f"{_shortened(self.first[reason][1])}"
                                     for reason, n in self.failed.most_common()) + ")"
        text += f", {retried} retried, {seconds:.1f} s, {self.answered / max(seconds, 1e-9):.0f} lines/s"
        left = to_send - self.answered - failed
        if self.interrupted and left:
            text += f"; stopped with {left} line(s) not written"
        if (failed or (self.interrupted and left)) and output:
            text += f"; --resume --output {output} sends only what is not answered yet"
        prefix = "error: " if code and not self.interrupted else "warning: " if failed else ""
        return f"aot: {prefix}{text}"


def _shortened(message: str) -> str:
    """A long message cut in its middle: its start says what failed, its end why it was given up."""
    if len(message) <= SHOWN_ERROR:
        return message
    tail = message[message.rfind("(given up: "):] if "(given up: " in message else message[-SHOWN_ERROR // 3:]
    return message[:max(SHOWN_ERROR - len(tail) - 5, 40)] + " ... " + tail


class TopK:
    """--top-k K on answers one by one (aot.cli.ranking): a classification's K most probable labels named from the
    server's task listing, a multi-label answer's K highest scores; notes() says afterwards what it could not rank."""

    def __init__(self, listing: dict, k: int):
        self.labels, self.k = ServedLabels(listing), k
        self.unnamed: set[str] = set()
        self.unranked: list[dict] = []  # the kind's key of each answer with no labels to rank (unranked_note)

    def rank(self, answer: dict) -> dict:
        if "error" in answer:
            return answer
        if isinstance(answer.get("scores"), dict):
            return top_scores(answer, self.k)
        names = self.labels.of(answer) if "probabilities" in answer else None
        if names is not None:
            return top_labels(answer, names, self.k)
        if "probabilities" in answer:
            self.unnamed.add(answer.get("version", "?"))
        else:
            self.unranked.append({key: None for key in ("score", "embedding", "entities") if key in answer})
        return answer

    def notes(self) -> None:
        unranked_note(self.unranked, self.k)
        if self.unnamed:
            print(f"aot: warning: --top-k: no label names for {', '.join(sorted(self.unnamed))} (a version the "
                  "server no longer lists, whose labels changed since): those answers keep their logits and "
                  "probabilities", file=sys.stderr)
