"""The README's main command, end to end on the real MiniLM, in a reduced form (a small train subset)."""

import os
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow
def test_demo_script_trains_exports_serves_and_infers(tmp_path):
    env = {**os.environ, "AOT_DEMO_DIR": str(tmp_path / "demo"), "AOT_DEMO_SAMPLES": "320",
           "AOT_GRPC_PORT": _port(), "AOT_HTTP_PORT": _port(), "AOT_METRICS_PORT": _port(),
           "AOT_HEALTH_PORT": _port()}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "served == aot predict: labels equal" in result.stdout
    served = (tmp_path / "demo" / "served.jsonl").read_text().splitlines()
    assert len(served) == 2 and all('"label"' in line for line in served)
    repo = tmp_path / "demo" / "repo"
    assert (repo / "models" / "backbone" / "1" / "model.onnx").is_file()
    assert any(p.name.startswith("sentiment@") for p in (repo / "tasks").iterdir())
