"""The supervisor's calls to one tritonserver's HTTP API: the control API authenticated with the admin key (never
logged), and a record of when the server's front end last answered anything.

That record is how the supervisor tells a saturated or frozen front end from a hung step: a step's liveness probe
travels through the front end, so when tritonserver accepts no connection (its open files exhausted by idle
clients, or the process stopped) every probe goes unanswered while every stub is fine. A step's silence counts only
from when the front end last began answering (`answering_since`: reset when its own liveness or the model index
goes unanswered), so neither the saturation nor the moments after it make a step look hung
(aot.serving.supervision.probes)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from aot.serving.supervision.admin_key import ADMIN_HEADER

# What a call raises when the server cannot answer it right now (a busy or restarting server: refused, timed out, a
# connection dropped mid-answer)
UNREACHABLE = (urllib.error.URLError, OSError, http.client.HTTPException)
FRONT_END_TIMEOUT = 2.0  # seconds for the front end's own liveness (/v2/health/live: no model involved)


@dataclass
class TritonApi:
    http_url: str  # host:port
    admin_key: str | None = field(default=None, repr=False)  # sent with every control API call
    answered: float = field(default_factory=time.monotonic)  # time.monotonic() of the front end's last answer
    # since when the front end has answered without a pause (None: its last check went unanswered)
    answering_since: float | None = field(default_factory=time.monotonic)

    def request(self, path: str, body: bytes | None = None, timeout: float = 5.0, admin: bool = False) -> bytes:
        headers = {"Content-Type": "application/json"}
        if admin and self.admin_key:
            headers[ADMIN_HEADER] = self.admin_key
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=body, headers=headers,
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                data = response.read()
        except urllib.error.HTTPError:
            self._answer()  # an error status is an answer: the front end works
            raise
        self._answer()
        return data

    def _answer(self) -> None:
        self.answered = time.monotonic()
        if self.answering_since is None:
            self.answering_since = self.answered

    def post(self, path: str, timeout: float, body: dict | None = None) -> None:
        self.request(path, json.dumps(body or {}).encode(), timeout, admin=True)

    def index(self, timeout: float = 10.0) -> list[dict]:
        try:
            return json.loads(self.request("/v2/repository/index", b"{}", timeout, admin=True))
        except UNREACHABLE as exc:
            if not isinstance(exc, urllib.error.HTTPError):
                self.answering_since = None
            raise

    def config(self, model: str, timeout: float = 5.0) -> dict:
        """The model's loaded config (the model-config API, with the key)."""
        return json.loads(self.request(f"/v2/models/{model}/config", timeout=timeout, admin=True))

    def load(self, model: str, timeout: float, config: dict | None = None) -> None:
        """Load the model (from its files, or with `config`: a loaded model whose config changes only in its
        instance groups is updated in place: aot.serving.supervision.instance_groups)."""
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else None
        self.post(f"/v2/repository/models/{model}/load", timeout, body)

    def unload(self, model: str, timeout: float) -> None:
        self.post(f"/v2/repository/models/{model}/unload", timeout)

    def model_ready(self, model: str) -> bool:
        try:
            self.request(f"/v2/models/{model}/ready", timeout=2)
            return True
        except UNREACHABLE:
            return False

    def front_end_answers(self) -> bool:
        """tritonserver's HTTP front end answers its own liveness now (it asks no model)."""
        try:
            self.request("/v2/health/live", timeout=FRONT_END_TIMEOUT)
            return True
        except UNREACHABLE:
            self.answering_since = None
            return False
