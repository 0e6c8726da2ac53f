"""The GPU deployment files, checked offline (no Docker engine here)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_is_valid():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is not installed: scripts/setup.sh installs Debian's docker-compose package")
    result = subprocess.run([compose, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_compose_serves_the_local_binary_release_on_a_gpu():
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    triton, builder = spec["services"]["triton"], spec["services"]["engine-builder"]
    assert builder["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"  # = Triton 2.51, the wheel's binary
    assert "24.10-py3" in (ROOT / "docker" / "Dockerfile").read_text()
    assert set(triton["ports"]) == {"8000:8000", "8001:8001", "8002:8002"}
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert triton["depends_on"]["engine-builder"]["condition"] == "service_completed_successfully"
    for service in (triton, builder):
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert "--model-repository=/repo/models" in triton["command"]


def test_dockerfile_installs_only_the_pinned_serving_extra():
    """The image gets `serving` and the model files, the [serve] extra pinned, and nothing that imports torch."""
    import re
    import tomllib

    text = (ROOT / "docker" / "Dockerfile").read_text()
    for package in ("serving", "model_repository"):
        assert f"COPY {package} ./{package}" in text
    for package in ("aot", "training", "exporter", "benchmarks"):
        assert f"COPY {package} " not in text
    assert not re.search(r"pip install[^\n]*torch", text)
    pins = dict(re.findall(r"([a-z_]+)==([0-9.]+)", text))
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    for requirement in extra:
        name = re.match(r"[a-z_]+", requirement).group(0)
        assert name in pins, f"{name} of the [serve] extra is not pinned in the Dockerfile"
    assert pins["numpy"].startswith("1.")


def test_compose_runs_tritonserver_under_the_supervisor():
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = spec["services"]["triton"]["command"]
    assert command[:4] == ["python3", "-m", "serving.supervisor", "tritonserver"]
