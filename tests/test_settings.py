"""One settings module (aot/settings.py): every AOT_* variable with its type, default and meaning, read through
typed helpers that name a bad value; docs/configuration.md is generated from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aot import settings
from aot.serving import protocol

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*sorted((ROOT / "aot").rglob("*.py")), *sorted((ROOT / "scripts").glob("*.sh")),
           *sorted((ROOT / "deploy").rglob("*.yaml")), *sorted((ROOT / "deploy").rglob("*.env")),
           ROOT / "docker-compose.yml", *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
TENSORS = {protocol.AOT_ROWS, protocol.AOT_INDEX, protocol.AOT_ROW_OFFSETS, protocol.AOT_BIAS}
TENSOR_CONSTANTS = {"AOT_ROWS", "AOT_INDEX", "AOT_ROW_OFFSETS", "AOT_BIAS"}  # protocol's names of tensors


def test_docs_configuration_is_generated_from_the_settings():
    assert (ROOT / "docs" / "configuration.md").read_text() == settings.markdown(), \
        "docs/configuration.md is stale: python -m aot.settings > docs/configuration.md"
    done = subprocess.run([sys.executable, "-m", "aot.settings"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout == settings.markdown()


def test_every_variable_the_project_names_is_a_setting():
    named = {s.name for s in settings.SETTINGS}
    assert len(named) == len(settings.SETTINGS) >= 30
    seen = set()
    for path in SOURCES:
        seen |= set(re.findall(r"\bAOT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
    seen -= TENSOR_CONSTANTS
    assert seen, "no AOT_ variable found: the scan reads nothing"
    assert seen <= named, f"variables without a setting: {sorted(seen - named)}"
    assert named <= seen, f"settings nothing reads or names: {sorted(named - seen)}"


def test_code_reads_the_environment_only_through_the_settings():
    """No module but aot/settings.py reads an AOT_ variable by its literal name."""
    offenders = []
    for path in sorted((ROOT / "aot").rglob("*.py")):
        if path.name == "settings.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""["']AOT_[A-Z_]+["']""", line) and not re.search("|".join(TENSOR_CONSTANTS), line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("setting, raw, value", [
    (settings.METRICS_TASKS, None, 100),
    (settings.METRICS_TASKS, "", 100),
    (settings.METRICS_TASKS, "7", 7),
    (settings.METRICS_TASKS, "0", 0),
    (settings.REQUEST_LOG_SAMPLE, "0.25", 0.25),
    (settings.REQUEST_LOG_TEXT, "1", True),
    (settings.REQUEST_LOG_TEXT, "false", False),
    (settings.LOAD_VANILLA, "0", False),
    (settings.HEALTH_PORT, None, 8003),
    (settings.URL, "10.0.0.1:9001", "10.0.0.1:9001"),
    (settings.TASK_CACHE_BYTES, "1024", 1024),
    (settings.POOL_BYTES, None, None),
    (settings.POOL_BYTES, "0", 0),  # no pool, as `aot serve --pool-bytes 0`
    (settings.DRAIN_SECONDS, None, 10.0),
    (settings.DRAIN_SECONDS, "2.5", 2.5),
    (settings.TOKENIZER_THREADS, None, None),
    (settings.TOKENIZER_THREADS, "4", 4),
])
def test_a_setting_reads_its_type_and_default(setting, raw, value):
    environ = {} if raw is None else {setting.name: raw}
    assert setting.read(environ) == value


@pytest.mark.parametrize("setting, raw, expected", [
    (settings.METRICS_TASKS, "-1", "a non-negative integer"),
    (settings.METRICS_TASKS, "many", "a non-negative integer"),
    (settings.REQUEST_LOG_SAMPLE, "1.5", "a share of requests from 0 to 1"),
    (settings.HEALTH_PORT, "http", "a port number"),
    (settings.TASK_CACHE_BYTES, "10GB", "a number of bytes (an integer, 0 or more)"),
    (settings.POOL_BYTES, "-1", "a number of bytes (an integer, 0 or more)"),
    (settings.DRAIN_SECONDS, "-1", "a number of seconds, 0 or more"),
    (settings.DRAIN_SECONDS, "inf", "a number of seconds, 0 or more"),
    (settings.TOKENIZER_THREADS, "0", "a number of threads, 1 or more"),
])
def test_a_bad_value_is_refused_with_its_name_and_what_was_expected(setting, raw, expected):
    with pytest.raises(settings.SettingError) as caught:
        setting.read({setting.name: raw})
    assert str(caught.value) == f"{setting.name}={raw!r}: expected {expected}"


@pytest.mark.parametrize("environ, on_gpu, instances, cores, threads", [
    ({}, False, 1, 16, 1),  # a CPU step: its cores run the engine
    ({}, True, 2, 16, 8),  # a GPU step: the host's cores over its instances
    ({}, True, 2, 64, 8),  # at most MAX_DEFAULT_TOKENIZER_THREADS
    ({}, True, 4, 6, 1),  # never 0
    ({"AOT_TOKENIZER_THREADS": "3"}, False, 1, 16, 3),  # the setting wins
    ({"AOT_TOKENIZER_THREADS": "12"}, True, 2, 16, 12),
])
def test_a_steps_tokenizer_threads(monkeypatch, environ, on_gpu, instances, cores, threads):
    from aot.serving.tokenization import tokenizer_threads, use_tokenizer_threads

    monkeypatch.delenv(settings.TOKENIZER_THREADS.name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert tokenizer_threads(on_gpu, instances, cores) == threads
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "unset")
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    use_tokenizer_threads(threads)  # what the tokenizers library reads
    assert (os.environ["TOKENIZERS_PARALLELISM"], os.environ.get("RAYON_NUM_THREADS")) == (
        ("true", str(threads)) if threads > 1 else ("false", None))
