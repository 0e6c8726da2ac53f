"""The benchmark commands in a tiny configuration: they run and their JSON has the documented fields; `aot bench`
comes from the benchmarks package as a plugin of `aot`.
(Speed numbers are never asserted in tests; they are measured side by side in one run by the benchmarks.)"""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib

from aot.benchmarks.cli import add_bench
from aot.cli import main as cli
from aot.cli.main import main
from tests.helpers import train_tiny_task

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def bench_plugin(monkeypatch):
    """This checkout's `bench`, registered in code: an install older than the plugin's entry point does not declare
    it, and the entry point names the same function (test_bench_plugin_is_the_declared_entry_point)."""
    monkeypatch.setitem(cli.REGISTERED, "bench", add_bench)


def test_bench_plugin_is_the_declared_entry_point():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["aot.commands"] == {"bench": "aot.benchmarks.cli:add_bench"}
    assert cli.SHIPPED_PLUGINS == {"bench": "bench"} and "bench" in project["optional-dependencies"]


def test_commands_come_from_installed_entry_points(tmp_path, monkeypatch, capsys):
    """A plugin found through the entry-point group as an installed distribution declares it (here one on sys.path),
    listed in `aot --help` and run like the commands aot defines; one whose module is gone says what is missing."""
    (tmp_path / "hello_plugin.py").write_text(
        "def add(sub):\n"
        "    p = sub.add_parser('hello', help='says hello')\n"
        "    p.add_argument('--name', default='world')\n"
        "    p.set_defaults(run=lambda args: print(f'hello {args.name}'))\n")
    info = tmp_path / "hello_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[aot.commands]\nhello = hello_plugin:add\ngone = gone_plugin:add\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hello_plugin", raising=False)
    text = cli.build_parser().format_help()
    assert "says hello" in text and "bench" in text
    assert main(["hello", "--name", "aot"]) == 0 and capsys.readouterr().out == "hello aot\n"
    assert main(["gone", "--anything"]) == 2
    assert capsys.readouterr().err == "aot: error: the plugin of the gone command does not load: No module named " \
                                      "'gone_plugin'\n"


def test_python_m_benchmarks_is_aot_with_bench_from_a_checkout():
    """`python -m aot.benchmarks` (scripts/gpu-check.sh): `aot` with `bench` for a checkout on PYTHONPATH, installed or
    not."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "aot.benchmarks", "bench", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: aot bench") and "overhead" in done.stdout


def test_missing_plugin_says_what_to_install(monkeypatch, capsys):
    monkeypatch.delitem(cli.REGISTERED, "bench")
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    assert "bench" in cli.build_parser().format_help()  # listed, installed or not
    for argv in (["bench", "overhead", "--out", "x"], ["bench", "--help"]):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert captured.err.startswith("aot: error: the bench command comes from a plugin that is not installed")
        assert "pip install '.[bench]' in a checkout of this project" in captured.err

OVERHEAD_FIELDS = {"model", "method", "batch", "seq", "median_ms", "ratio_to_vanilla", "engine", "device"}


@pytest.mark.parametrize("engine", ["torch", "onnxruntime"])
def test_overhead_tiny(tmp_path, tiny_models, engine, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "overhead", "--models", str(tiny_models["bert"]), "--batch", "2", "--seq", "16",
                 "--repeats", "2", "--warmup", "1", "--engine", engine, "--out", str(out), "--no-progress"])
    assert code == 0
    records = json.loads((out / "overhead.json").read_text())
    assert {r["method"] for r in records} == {"vanilla", "aot-fused", "aot-dense", "aot-factored", "lora", "adapter",
                                              "prompt", "prefix"}
    for r in records:
        assert OVERHEAD_FIELDS <= set(r)
    ran = [r for r in records if r["median_ms"] is not None]
    assert {r["method"] for r in ran} >= {"vanilla", "aot-fused", "aot-factored"}
    # the dense bias interface is an input of the exported graphs: timed by the onnxruntime engine only
    assert ("aot-dense" in {r["method"] for r in ran}) == (engine == "onnxruntime")
    assert all(r["median_ms"] > 0 and r["ratio_to_vanilla"] > 0 for r in ran)
    assert next(r for r in records if r["method"] == "vanilla")["ratio_to_vanilla"] == 1.0
    assert (out / "overhead.md").read_text().startswith("# Inference overhead")
    assert (out / "overhead.png").stat().st_size > 1000


def test_bound_session_equals_a_plain_run(tmp_path, tiny_models):
    """The onnxruntime engine's GPU path (inputs bound in place, the lookup on the device) on the CPU device: both
    bias interfaces give the states of the server's own lookup and batching (aot.serving.engine.BackboneRunner), with
    each request's own rows laid out as Triton's batcher concatenates them (a padded request included)."""
    import torch

    from aot.benchmarks.overhead.cases import make_case
    from aot.benchmarks.overhead.onnxruntime_engine import BoundSession, device_bias_feeds
    from aot.exporter.onnx_export import export_backbone_graph
    from aot.serving import protocol
    from aot.serving.engine import BackboneRunner, EncoderBatch
    from tests.tiny import tiny_backbone

    backbone = tiny_backbone("bert")
    L, d, V = backbone.num_layers, backbone.hidden_size, backbone.embeddings.shape[0]
    table = torch.from_numpy((np.random.default_rng(0).standard_normal((V, L, d)) * 0.5).astype(np.float16))
    case = make_case(backbone.encoder, 3, 10, torch.device("cpu"), torch.float32)
    lengths = [10, 10, 7]
    case.mask[2, 7:] = 0
    tokens = {protocol.INPUT_IDS: case.ids, protocol.ATTENTION_MASK: case.mask, protocol.TOKEN_TYPE_IDS: case.token_types}
    batch = EncoderBatch.joined([{k: v.numpy() for k, v in tokens.items()}])
    batch.index, batch.rows, distinct = np.zeros((3, 10), np.int64), [], []
    for b, n in enumerate(lengths):  # each sequence's own rows, as the server's lookup gives them
        unique, index = np.unique(case.ids[b, :n].numpy(), return_inverse=True)
        batch.index[b] = sum(distinct)
        batch.index[b, :n] += index
        distinct.append(len(unique))
        batch.rows.append(table.numpy()[unique])
    rows_feeds = device_bias_feeds(case, table, "rows")
    assert rows_feeds[protocol.AOT_ROW_OFFSETS].tolist() == [0, *np.cumsum(distinct) * L * d]
    assert rows_feeds[protocol.AOT_ROWS].shape == (sum(distinct) * L * d,) and rows_feeds[protocol.AOT_INDEX].shape == (3, 10)
    assert device_bias_feeds(case, table, "dense")[protocol.AOT_BIAS].shape == (3, 10, L, d)
    states = {}
    for interface in protocol.BIAS_INTERFACES:
        graph = export_backbone_graph(backbone, tmp_path / interface, aot=True, interface=interface).optimized
        expected = BackboneRunner(graph).run(batch).pooled
        got = BoundSession(graph, torch.device("cpu")).run({**tokens, **device_bias_feeds(case, table, interface)}, d)
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-4)
        states[interface] = expected
    np.testing.assert_allclose(states["rows"], states["dense"], atol=1e-4)


def test_overhead_int8_tiny(tmp_path, tiny_models, capsys):
    """--precision int8 times the int8 twins of the graphs, one request at a time, as the CPU configs run them."""
    out = tmp_path / "bench"
    assert main(["bench", "overhead", "--models", str(tiny_models["bert"]), "--batch", "2", "--seq", "16",
                 "--repeats", "2", "--warmup", "1", "--engine", "onnxruntime", "--methods", "aot-fused",
                 "--precision", "int8", "--threads", "1", "--out", str(out), "--no-progress"]) == 0
    records = json.loads((out / "overhead.json").read_text())
    assert {r["method"] for r in records} == {"vanilla", "aot-fused"} and {r["dtype"] for r in records} == {"int8"}
    assert all(r["median_ms"] > 0 for r in records) and {r["threads"] for r in records} == {1}
    assert "int8 graphs, 1 thread(s) per graph" in (out / "overhead.md").read_text()
    assert main(["bench", "overhead", "--precision", "int8", "--out", str(out)]) == 2  # the torch engine: refused
    assert main(["bench", "overhead", "--threads", "2", "--out", str(out)]) == 2
    assert "--threads 2 applies to --engine onnxruntime --device cpu" in capsys.readouterr().err


def test_overhead_threads_default_to_one_served_instance(monkeypatch):
    """Without --threads the graphs run with the threads one instance of the CPU server's fused step gets by
    default: the cores divided among the default --cpu-instances."""
    from aot.benchmarks.overhead.cases import OverheadConfig
    from aot.benchmarks.overhead.onnxruntime_engine import cpu_threads
    from aot.serving.repository import ServingOptions

    config = OverheadConfig(models=["minilm"], batches=[1], seqs=[8], methods=["vanilla"], engine="onnxruntime")
    instances = ServingOptions().cpu_instances
    for cores in (1, 2, 8):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert cpu_threads(config) == max(cores // instances, 1)
    config.threads = 3
    assert cpu_threads(config) == 3


def test_overhead_rejects_unknown_method(tmp_path, capsys):
    assert main(["bench", "overhead", "--methods", "vanilla,magic", "--out", str(tmp_path)]) == 2
    assert "unknown method(s) ['magic']" in capsys.readouterr().err
    assert main(["bench", "overhead", "--engine", "onnxruntime", "--dtype", "bf16", "--out", str(tmp_path)]) == 2
    assert "--dtype bf16 applies to --engine torch" in capsys.readouterr().err


@pytest.mark.server
@pytest.mark.parametrize("engine", ["onnx", "torch"])
def test_serve_bench_tiny(tmp_path, tiny_models, sentiment_dir, engine):
    task = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path / "task", "fc", epochs=1)
    out = tmp_path / "bench"
    # the torch engine's pool holds a few hundred rows, not the 8 tasks' tables: served from a pool they overflow
    pool = ["--pool-bytes", "60000"] if engine == "torch" else []
    # the onnx engine: fp32 and int8 repositories side by side in one run
    precisions = ["fp32", "int8"] if engine == "onnx" else ["fp32"]
    assert main(["bench", "serve", "--task", str(task), "--out", str(out), "--tasks", "1,2", "--concurrency", "2",
                 "--storage", "fused", "--requests", "12", "--engine", engine, "--no-progress", *pool,
                 "--precision", ",".join(precisions)]) == 0
    records = json.loads((out / "serve.json").read_text())
    memory = [r for r in records if r["kind"] == "memory"]
    latency = [r for r in records if r["kind"] == "latency"]
    assert [(r["precision"], r["tasks"]) for r in memory] == [(p, n) for p in precisions for n in (1, 2)]
    assert all(r["rss_mb"] > 50 and r["ready_seconds"] > 0 for r in memory)
    assert {(r["precision"], r["model"], r["tasks_in_flight"]) for r in latency} == {
        (p, m, n) for p in precisions for m, n in (("vanilla", 1), ("aot", 1), ("aot", 8))}
    for r in latency:
        assert r["errors"] == 0 and r["throughput_rps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0
        # three rounds (the default) in rotating order, the record their median
        assert r["rounds"] == 3
        assert r["throughput_rps"] == pytest.approx(np.median(r["throughput_rps_rounds"]), abs=0.01)
        assert isinstance(r["memory_fallbacks"], int)  # counted from the server log (test_memory_fallbacks_...)
        assert r["pool_bytes"] == (60000 if pool else 1 << 30)
        # torch: the pool holds the rows; onnx: the fused step's 2 instances read fused tables through their shared
        # memory maps, so nothing is looked up in a pool
        assert (r["pool_hit_rate"] is None) == (r["model"] == "vanilla" or engine == "onnx")
        if r["model"] == "aot":
            assert 0 < r["lookup_bytes_per_request"] < r["dense_bias_bytes_per_request"]
    # the hit rate is counted by the server's steps: a cache misses the rows the first AoT pass touches first
    rates = [r["pool_hit_rate"] for r in latency if r["model"] == "aot"]
    if engine == "torch":
        assert all(0 <= h <= 1 for h in rates) and min(rates) < 1, rates
    parity = {r["precision"]: r for r in records if r["kind"] == "parity"}
    assert set(parity) == set(precisions) and all(r["same_label"] == 1.0 for r in parity.values())
    assert parity["fp32"]["max_abs_logit_diff"] < 1e-3  # against aot predict (fp16 rows)
    if "int8" in parity:  # against aot predict --repo, the int8 engine in process
        assert parity["int8"]["max_abs_logit_diff"] < 1e-4
        accuracy = [r for r in records if r["kind"] == "accuracy"]
        assert [r["precision"] for r in accuracy] == ["int8"] and 0 <= accuracy[0]["score"] <= 1
        assert "× fp32" in (out / "serve.md").read_text()
    assert f"(cpu, {engine} engine)" in (out / "serve.md").read_text()
    assert (out / "serve.md").is_file() and (out / "serve.png").is_file()


@pytest.mark.server
def test_tasks_bench_tiny(tmp_path, tiny_models, sentiment_dir):
    task = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path / "task", "fc", epochs=1)
    out = tmp_path / "bench"
    # one count (3 tasks): each of the 3 modes' 2 runs is a fresh server (a second count would double them)
    assert main(["bench", "tasks", "--task", str(task), "--counts", "3", "--popularity", "zipf", "--repeats", "2",
                 "--concurrency", "2", "--requests", "12", "--pool-bytes", "6000", "--policy-requests", "200",
                 "--out", str(out), "--no-progress"]) == 0
    data = json.loads((out / "tasks.json").read_text())
    records = data["records"]
    assert {(r["tasks"], r["mode"], r["popularity"]) for r in records} == {
        (3, m, "zipf") for m in ("fused-mmap", "factored", "pool")}
    for r in records:
        assert len(r["throughput_runs"]) == 2 and r["throughput_rps"] == max(r["throughput_runs"])  # median of 2
        assert r["errors"] == 0 and r["throughput_rps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 and r["rss_mb"] > 50
        if r["mode"] == "pool":
            assert 0 <= r["hit_rate"] <= 1
        else:
            assert r["hit_rate"] is None
    policies = data["policies"]
    assert sorted((r["policy"], r["popularity"], r["pool_rows"]) for r in policies) == sorted(
        (p, "zipf", rows) for p in ("lru", "lfu") for rows in (46, 5))  # 6000 and 750 bytes
    for r in policies:
        assert r["tasks"] == 3 and r["requests"] == 200 and not r["resident"] and 0 < r["hit_rate"] <= 1
    assert (out / "tasks.md").read_text().startswith("# Tasks scaling") and (out / "tasks.png").stat().st_size > 1000
    assert "## Eviction policies" in (out / "tasks.md").read_text()


@pytest.mark.server
def test_scale_bench_tiny(tmp_path, tiny_models, sentiment_dir):
    """`aot bench tasks --scale` on a tiny task, the store growing 1 -> 30: every figure measured, no error and no
    wrong answer, a publish read by a server as one small change (as many bytes into 30 tasks as into 1), reports
    written."""
    task = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path / "task", "fc", epochs=1)
    out = tmp_path / "bench"
    assert main(["bench", "tasks", "--scale", "--task", str(task), "--counts", "1,30", "--concurrency", "2",
                 "--requests", "16", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "scale.json").read_text())
    records = report["records"]
    assert [r["tasks"] for r in records] == [1, 30]
    for r in records:
        assert r["errors"] == 0 and r["wrong"] == 0 and r["ready_s"] > 0 and r["rss_after_total_mb"] > 50
        assert 50 < r["pss_after_total_mb"] <= r["rss_after_total_mb"] and r["host_cache_bytes"] > 0
        assert r["zipf_rps"] > 0 and r["hot_rps"] > 0
        assert r["steady_rps"] > 0 and r["steady_vs_hot"] == round(r["steady_rps"] / r["hot_rps"], 3)
        if r["busy_cold_requests"]:  # half the untouched tail of the store (none of 1 task)
            assert r["busy_cold_p99_ms"] >= r["busy_cold_p50_ms"] > 0 and r["busy_warm_p50_ms"] > 0
            assert r["busy_cold_vs_warm"] == round(r["busy_cold_p99_ms"] / r["busy_warm_p50_ms"], 2)
        assert 1 <= r["steady_tasks"] <= r["tasks"]  # the steady pass replays warm-up draws: tasks seen already
        assert r["publish_bytes_read"] > 0 and r["publish_writer_bytes"] > 0 and r["publish_to_served_s"] > 0
    assert records[0]["busy_cold_requests"] == 0 and records[1]["busy_cold_requests"] > 0  # 1 task: none untouched
    assert records[0]["cold_p50_ms"] is None  # one task: none untouched
    assert records[1]["cold_p99_ms"] >= records[1]["cold_p50_ms"] > 0
    fused = records[1]  # fused tasks join the store after the 1-task baseline: their cold first requests too
    assert records[0]["fused_tasks"] == 0 and fused["fused_tasks"] == 14 and fused["fused_busy_cold_requests"] == 7
    assert fused["fused_cold_p99_ms"] >= fused["fused_cold_p50_ms"] > 0 and fused["fused_busy_cold_p99_ms"] > 0
    assert set(fused["instances_pss_mb"]) == {"2", "4"} and all(v > 50 for v in fused["instances_pss_mb"].values())
    cyclic = {p["policy"]: p["hit_rate"] for p in report["policies"] if p["trace"].startswith("cyclic")}
    assert cyclic["lru"] == 0.0 and cyclic["tinylfu"] > 0.5
    one, many = records  # a publish costs a reader what changed, not the store's size
    assert many["publish_bytes_read"] <= 1.5 * one["publish_bytes_read"], records
    assert (out / "scale.md").read_text().startswith("# One server, many tasks") and (out / "scale.png").is_file()


def test_version_policies_replay_shows_lru_failing_a_cycle_and_tinylfu_not():
    """The version cache's replay (aot.benchmarks.tasks.version_policies): a cyclic working set 10 % larger than the cache
    gets no hit from LRU and most from the host's W-TinyLFU; under Zipf W-TinyLFU hits at least as often."""
    import numpy as np

    from aot.benchmarks.tasks.version_policies import replay_version_policies

    draws = np.random.default_rng(1).zipf(1.2, 400) % 2000
    records = replay_version_policies(2 << 20, 100 << 20, 2000, draws, stream=3000)
    rate = {(r["trace"].split()[0] + " " + r["trace"].split()[1], r["policy"]): r["hit_rate"] for r in records}
    assert len(records) == 6 and {r["capacity"] for r in records} == {50}
    assert rate[("cyclic (1.1x", "lru")] == 0.0 and rate[("cyclic (1.1x", "tinylfu")] > 0.6
    assert rate[("zipf stream", "tinylfu")] >= rate[("zipf stream", "lru")] > 0
    assert rate[("zipf steady", "tinylfu")] >= rate[("zipf steady", "lru")]


def test_policy_replay_evicts_and_counts_every_lookup(tmp_path, tiny_models):
    """The replay of `aot bench tasks` through a pool of 8 rows for 20 tasks: it evicts, and hits + misses are every
    distinct token of the trace's second half."""
    from aot.benchmarks.tasks.modes import replay_policies
    from aot.serving.repository import read_repository
    from tests.helpers import make_repository

    info = read_repository(make_repository(tiny_models["bert"], tmp_path / "repo", {}))
    row_bytes = info.num_layers * info.hidden_size * 2
    records = replay_policies(info, tasks=20, popularity="zipf", pool_bytes=8 * row_bytes, requests=300, batch=1)
    assert [r["policy"] for r in records] == ["lru", "lfu"]
    for r in records:
        assert r["pool_rows"] == 8 and not r["resident"] and r["evictions"] > 0 and 0 < r["hit_rate"] < 1


def test_memory_fallbacks_are_counted_from_the_server_log(tmp_path):
    from aot.benchmarks.served.serve import _memory_fallbacks

    log = tmp_path / "tritonserver.log"
    log.write_text('W1123 pinned_memory_manager.cc:170] "failed to allocate pinned system memory: no pinned memory '
                   'pool, falling back to non-pinned system memory"\nI1123 model loaded\n'
                   'W1123 memory.cc:212] "failed to allocate GPU memory from pool, falling back to pinned memory"\n')
    assert _memory_fallbacks(log) == 2
    assert _memory_fallbacks(tmp_path / "missing.log") == 0


@pytest.mark.server
def test_tax_bench_tiny(tmp_path, tiny_models, sentiment_dir):
    """`aot bench tax` in seconds: every server process's CPU per request is read, the engine alone is the limit."""
    task = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path / "task", "fc", epochs=1)
    out = tmp_path / "bench"
    assert main(["bench", "tax", "--task", str(task), "--out", str(out), "--concurrency", "1,4", "--requests", "24",
                 "--batch", "1,4", "--cpu-instances", "1,2", "--no-progress"]) == 0
    records = json.loads((out / "tax.json").read_text())
    engine = [r for r in records if r["kind"] == "engine"]
    served = [r for r in records if r["kind"] == "served"]
    assert sorted((r["graph"], r["batch"], r["grouping"]) for r in engine) == [
        ("aot", 1, "by length"), ("aot", 4, "by length"),
        ("vanilla", 1, "by length"), ("vanilla", 4, "by length"), ("vanilla", 4, "padded")]
    assert all(r["throughput_rps"] > 0 and r["cpu_us_per_sequence"] > 0 for r in engine)
    assert all(r["graph_file"].endswith("/1/model.onnx") and not r["per_request"] for r in engine)
    assert sorted((r["model"], r["tasks_in_flight"], r["cpu_instances"], r["concurrency"], r["token_ids"])
                  for r in served) == sorted((m, n, k, c, ids) for m, n in (("vanilla", 1), ("aot", 1), ("aot", 8))
                                             for k in (1, 2) for c in (1, 4) for ids in (False, True))
    for r in served:
        assert r["errors"] == 0 and r["throughput_rps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0
        fused = {f"{m}{'' if k == 1 else f'#{k}'}" for m in ("aot", "vanilla") for k in range(1, r["cpu_instances"] + 1)}
        assert set(r["cpu_us_per_request"]) == {"tritonserver", "task_list"} | fused  # the CPU configs' steps
        assert r["cpu_us_per_request"][r["model"]] > 0 and r["engine_step_over_engine_us"] is not None
        assert r["tax_same_graph_us"] is not None
        assert r["server_cpu_us_per_request"] == pytest.approx(sum(r["cpu_us_per_request"].values()), abs=1)
        assert r["client_cpu_us_per_request"] > 0 and len(r["loadavg"]) == 2
        assert set(r["ceilings_rps"]) == {"tritonserver"}  # the fused steps run the engine: no one-thread ceiling
        assert r["x_vanilla"] is not None and r["x_engine"] > 0
    text = (out / "tax.md").read_text()
    assert text.startswith("# The serving tax (CPU, fp32 graphs")
    assert "Ceiling each process puts on a 16-core host" in text
    assert (out / "tax.png").stat().st_size > 1000


@pytest.mark.server
def test_tax_bench_torch_tiny(tmp_path):
    """--engine torch: the GPU configs' request path (the torch engine's fused step) on this CPU, serving the
    negligible encoder it builds (MiniLM's tokenizer, 1 layer, hidden 64) and a task it trains on it: for text,
    token-id and mixed clients, single-text and 8-text requests, the server's CPU by process per text and per
    request, the engines' own and outside the engine (structure and signs: no speed is asserted)."""
    out = tmp_path / "bench"
    assert main(["bench", "tax", "--engine", "torch", "--out", str(out), "--concurrency", "2", "--texts", "24",
                 "--min-requests", "4", "--texts-per-request", "1,8", "--clients", "text,mixed",
                 "--no-progress"]) == 0
    records = json.loads((out / "tax-torch.json").read_text())
    assert [(r["clients"], r["texts_per_request"], r["concurrency"], r["texts"], r["requests"]) for r in records] == [
        ("text", 1, 2, 24, 24), ("text", 8, 2, 32, 4), ("mixed", 1, 2, 24, 24), ("mixed", 8, 2, 32, 4)]
    for r in records:
        for unit in ("text", "request"):
            by_process = r[f"by_process_us_per_{unit}"]
            assert set(by_process) == {"tritonserver", "aot", "aot#2", "rest"}  # the step's 2 instances
            assert all(isinstance(v, float) and v > 0 for p, v in by_process.items() if p != "rest")
            assert by_process["rest"] >= 0
            assert r[f"server_cpu_us_per_{unit}"] == pytest.approx(  # the path: tritonserver and the instances
                sum(v for p, v in by_process.items() if p != "rest"), abs=1)
        assert r["by_process_us_per_request"]["tritonserver"] == pytest.approx(
            r["by_process_us_per_text"]["tritonserver"] * r["texts"] / r["requests"], rel=0.01, abs=1)
        assert r["engine_cpu_us_per_text"] > 0 and r["client_cpu_us_per_text"] > 0 and r["texts_per_s"] > 0
        assert r["outside_engine_us_per_text"] == pytest.approx(  # less the engines' and the path's idle CPU
            r["server_cpu_us_per_text"] - r["engine_cpu_us_per_text"]
            - r["idle_cpu_us_per_s"] * r["seconds"] / r["texts"], rel=0.01, abs=5)  # of rounded figures
        assert r["outside_engine_us_per_request"] == pytest.approx(
            r["outside_engine_us_per_text"] * r["texts"] / r["requests"], rel=0.01, abs=1)
        assert r["idle_cpu_us_per_s"] >= 0 and r["seconds"] > 0 and len(r["loadavg"]) == 2
    text = (out / "tax-torch.md").read_text()
    assert "1 layer, hidden 64" in text and "liveness probes on" in text
    for section in ("per text by process", "per request by process", "Issue 52's targets"):
        assert section in text
    assert "| tritonserver | aot | aot#2 | rest |" in text
    assert "| outside the engine, us a request, 1-text requests | - | 32 | - | ≤ 300 | not measured |" in text


def test_tax_bench_torch_refuses_bad_settings(tmp_path, capsys):
    """Checked before anything is built: request sizes above the served max batch; --engine onnx needs --task."""
    assert main(["bench", "tax", "--engine", "torch", "--out", str(tmp_path), "--texts-per-request", "1,200"]) == 2
    assert "--texts-per-request [200] exceeds the served max batch size 128" in capsys.readouterr().err
    assert main(["bench", "tax", "--out", str(tmp_path)]) == 2
    assert "--task is required with --engine onnx" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "tax", "--engine", "torch", "--out", str(tmp_path), "--clients", "text,robots"])
    assert exc.value.code == 2
    assert "unknown clients robots: expected some of text, ids, mixed" in capsys.readouterr().err


def test_tax_bench_int8_tiny(tmp_path, tiny_models, sentiment_dir):
    """--precision int8: the int8 repository is served, and the engine alone runs its int8 twins one request at a
    time whatever the batch, as its steps run them."""
    task = train_tiny_task(tiny_models["bert"], sentiment_dir, tmp_path / "task", "fc", epochs=1)
    out = tmp_path / "bench"
    assert main(["bench", "tax", "--task", str(task), "--out", str(out), "--concurrency", "4", "--requests", "16",
                 "--batch", "1,4", "--cpu-instances", "2", "--precision", "int8", "--no-progress"]) == 0
    records = json.loads((out / "tax.json").read_text())
    engine = [r for r in records if r["kind"] == "engine"]
    served = [r for r in records if r["kind"] == "served"]
    assert sorted((r["graph"], r["batch"], r["grouping"]) for r in engine) == [
        ("aot", 1, "by length"), ("aot", 4, "by length"), ("vanilla", 1, "by length"), ("vanilla", 4, "by length")]
    assert all(r["graph_file"].endswith("/1/model.int8.onnx") and r["per_request"] for r in engine)
    assert sorted((r["precision"], r["model"], r["tasks_in_flight"], r["token_ids"]) for r in served) == sorted(
        ("int8", m, n, ids) for m, n in (("vanilla", 1), ("aot", 1), ("aot", 8)) for ids in (False, True))
    assert all(r["errors"] == 0 and r["cpu_us_per_request"][r["model"]] > 0 for r in served)
    assert (out / "tax.md").read_text().startswith("# The serving tax (CPU, int8 graphs")


def test_s3_bench_refuses_too_few_tasks_and_writes_its_reports(tmp_path, capsys):
    """`aot bench s3` (the full run needs minutes: docs/benchmarks.md, "The task store on S3"): too few tasks for the cold
    requests is one clear error; the reports hold every figure of a record."""
    from aot.benchmarks.tasks.s3_store import S3BenchConfig, write_s3_reports

    assert main(["bench", "s3", "--task", str(tmp_path), "--tasks", "50", "--out", str(tmp_path / "out")]) == 2
    assert "--tasks 50: expected at least 100" in capsys.readouterr().err
    record = {"tasks": 100, "cached_rps_file": 40.0, "cached_rps_s3": 39.0, "cached_ratio": 0.975, "ready_one_s": 2.0,
              "ready_many_s": 2.5, "ready_ratio": 1.25, "fetched_at_start": 0, "cold_p50_ms": 30.0,
              "cold_p99_ms": 60.0, "busy_cold_p50_ms": 35.0, "busy_cold_p99_ms": 70.0, "busy_warm_p50_ms": 30.0,
              "busy_cold_vs_warm": 2.33, "busy_errors": 0, "paused_answers_cached": 500, "paused_failures_cached": 0,
              "paused_cold_error": "TaskUnavailable: ... s3://b/p ...", "paused_cold_recovered_s": 0.1,
              "publish_to_every_replica_p50_s": 1.5, "publish_to_every_replica_max_s": 1.8}
    write_s3_reports(record, tmp_path / "out", S3BenchConfig("task", str(tmp_path / "out"), tasks=100))
    assert json.loads((tmp_path / "out" / "s3.json").read_text())["record"] == record
    table = (tmp_path / "out" / "s3.md").read_text()
    assert "| S3 × file | 0.975 |" in table and "| ready, 100 tasks in the bucket (s) | 2.5 |" in table
    assert "| cold first request under load p99 (ms) | 70.0 |" in table


def test_kinds_bench_tiny(tmp_path, tiny_models):
    """`aot bench kinds` on the tiny encoder: 16 tasks of every kind served by one server, each task's served answers
    equal `aot predict`'s, both sets measured without an error, the ratio of their medians reported."""
    out = tmp_path / "bench"
    assert main(["bench", "kinds", "--model", str(tiny_models["bert"]), "--requests", "16", "--concurrency", "2",
                 "--repeats", "1", "--max-length", "16", "--check", "2", "--out", str(out), "--no-progress"]) == 0
    result = json.loads((out / "kinds.json").read_text())
    assert sorted(set(result["sets"]["mixed"])) == ["classification", "embedding", "multilabel", "tokens"]
    assert len(result["check"]) == 16 and all(c["same"] and c["errors"] == 0 for c in result["check"])
    assert result["summary"]["all_answers_equal_predict"] and result["summary"]["max_abs_diff"] < 1e-3
    assert sorted((r["set"], r["repeat"]) for r in result["records"]) == [("classification", 0), ("mixed", 0)]
    assert all(r["errors"] == 0 and r["throughput_rps"] > 0 for r in result["records"])
    median = result["summary"]["median_rps"]
    assert result["summary"]["ratio"] == pytest.approx(median["mixed"] / median["classification"], abs=1e-3)
    assert (out / "kinds.md").is_file()


def test_infinity_bench_sender_loop_and_report(tmp_path):
    """`aot bench infinity`'s HTTP sender through the closed loop every bench shares, against a stand-in
    /embeddings that refuses every fifth request: each text sent once, the refusals counted as errors; the report
    puts each row beside Infinity's at the same precision and concurrency."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from aot.benchmarks.served.infinity import http_sender, write_infinity_reports
    from aot.benchmarks.served.serve import closed_loop

    seen, lock = [], threading.Lock()

    class Embeddings(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as Infinity's server

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                seen.append((self.path, body))
                status = 500 if len(seen) % 5 == 0 else 200
            data = b'{"data": [{"embedding": [0.0]}]}'
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Embeddings)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = closed_loop(http_sender(server.server_address[1]), [f"text {i}" for i in range(40)], 4)
    finally:
        server.shutdown()
    assert result["errors"] == 8 and len(seen) == 40 and result["throughput_rps"] > 0
    assert sorted(b["input"][0] for _, b in seen) == sorted(f"text {i}" for i in range(40))
    assert {(path, b["model"]) for path, b in seen} == {("/embeddings", "minilm")}
    row = {"precision": "int8", "concurrency": 8, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0}
    write_infinity_reports([{**row, "server": "infinity", "model": "embeddings", "throughput_rps": 200.0},
                            {**row, "server": "aot serve", "model": "vanilla", "throughput_rps": 300.0},
                            {**row, "server": "aot serve", "model": "aot", "concurrency": 1, "throughput_rps": 90.0}],
                           tmp_path)
    lines = (tmp_path / "infinity.md").read_text().splitlines()
    assert "| aot serve | vanilla | int8 | 8 | 300.0 | 1.5 |" in "\n".join(lines)
    assert lines[6].startswith("| aot serve | aot | int8 | 1 | 90.0 | - |"), lines  # no Infinity row at concurrency 1


@pytest.mark.parametrize("bench", ["serve", "infinity"])
def test_an_unknown_precision_is_refused_before_any_work(bench, tmp_path, capsys):
    extra = ["--infinity", str(tmp_path / "infinity_emb")] if bench == "infinity" else []
    with pytest.raises(SystemExit) as exit_:
        main(["bench", bench, "--task", str(tmp_path), *extra, "--out", str(tmp_path / "out"), "--precision",
              "fp32,fp16"])
    assert exit_.value.code == 2
    assert "unknown precision fp16: expected some of fp32, int8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_unknown_storage_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--task", str(tmp_path), "--out", str(tmp_path / "out"), "--storage", "fused,table"])
    assert exit_.value.code == 2
    assert "unknown storage table: expected some of fused, factored" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_int8_data_writes_the_regression_and_pair_sets_aot_train_reads(tmp_path):
    """The int8 accuracy benchmark's two derived sets, read back by `aot train`'s loader: Rotten Tomatoes as 0/1
    scores in its own split, and BBC article pairs labelled by whether their topics match, half of each."""
    from aot.benchmarks.accuracy.int8_data import main as write_data
    from aot.training.data import load_task_data
    from aot.training.data.builtin import bbc_news, rotten_tomatoes

    assert write_data(["--out", str(tmp_path), "--pairs", "40", "--dev-pairs", "12"]) == 0
    score = load_task_data(str(tmp_path / "rt_score"))  # its task.json says regression
    reviews = rotten_tomatoes()
    assert score.spec.kind == "regression" and score.spec.metric == "pearson_spearman"
    for split in ("train", "dev"):
        assert [(ex.text, ex.label) for ex in score.splits[split]] == [
            (ex.text, 1.0 if ex.label == "positive" else 0.0) for ex in reviews.splits[split]]
    pairs = load_task_data(str(tmp_path / "bbc_pairs"))
    articles = bbc_news()
    for split, count in (("train", 40), ("dev", 12)):
        topic = {ex.text: ex.label for ex in articles.splits[split]}  # each pair from its own split's articles
        rows = pairs.splits[split]
        assert len(rows) == count and sum(ex.label == "same" for ex in rows) == count // 2
        assert all(ex.text != ex.text_pair for ex in rows)
        assert all((topic[ex.text] == topic[ex.text_pair]) == (ex.label == "same") for ex in rows)
    with pytest.raises(SystemExit):
        write_data(["--out", str(tmp_path), "--pairs", "1"])


# --- aot bench gpu-perf (the GPU check's perf stage): the pieces that run without a GPU -------------------------

PERF_ANALYZER_CSV = (  # perf_analyzer 2.60's -f file for one concurrency, server statistics on (latencies in us)
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
    "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
    "32,12800.5,21,340,1200,80,2100,40,15,4012,5100,5500,7250\n")


def test_perf_analyzer_csv_gives_texts_requests_and_latencies_in_ms():
    from aot.benchmarks.gpu.load import parse_perf_analyzer_csv

    figures = parse_perf_analyzer_csv(PERF_ANALYZER_CSV, texts_per_request=64)
    assert figures["texts_per_s"] == 12800.5 and figures["requests_per_s"] == 200.0  # Inferences/Second counts texts
    assert (figures["p50_ms"], figures["p90_ms"], figures["p99_ms"]) == (4.012, 5.1, 7.25)
    assert figures["server_queue_ms"] == 1.2 and figures["server_compute_ms"] == 2.22


@pytest.mark.parametrize("text, said", [
    ("Concurrency,Inferences/Second,Client Send,Client Recv,p50 latency,p99 latency\n", "no measurement"),
    ("Concurrency,Inferences/Second\n1,10\n", "lacks the columns ['p50 latency', 'p99 latency']"),
])
def test_perf_analyzer_csv_without_figures_is_refused(text, said):
    from aot.benchmarks.gpu.load import LoadError, parse_perf_analyzer_csv

    with pytest.raises(LoadError, match=re.escape(said)):
        parse_perf_analyzer_csv(text, texts_per_request=1)


def test_perf_analyzer_command_carries_the_admin_key_and_the_request_size(tmp_path):
    """perf_analyzer reads the restricted model config and statistics: the key goes as gRPC metadata (-H), and -b is
    the texts a request carries; the log shows the command without the key."""
    from aot.benchmarks.gpu.load import Window, perf_analyzer_command, shown
    from aot.serving.supervision.admin_key import GRPC_ADMIN_HEADER

    key = "k" * 32
    command = perf_analyzer_command("/pa/perf_analyzer", Window("aot-8", 64, 256), "127.0.0.1:9001", key,
                                    tmp_path / "input.json", tmp_path / "w.csv", 1500)
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "/pa/perf_analyzer"
    assert flags["-H"] == f"{GRPC_ADMIN_HEADER}:{key}" == f"triton-grpc-protocol-aot-admin-key:{key}"
    assert (flags["-m"], flags["-i"], flags["-b"], flags["--concurrency-range"]) == ("aot", "grpc", "64", "256")
    assert flags["--input-data"] == str(tmp_path / "input.json") and flags["-f"] == str(tmp_path / "w.csv")
    assert perf_analyzer_command("pa", Window("vanilla", 1, 1), "u", key, tmp_path, tmp_path, 1)[2] == "vanilla"
    assert key not in shown(command) and f"{GRPC_ADMIN_HEADER}:KEY" in shown(command)


def test_the_documented_perf_analyzer_command_carries_the_admin_key():
    """docs/serving.md's command is the one the GPU check runs, by hand: without -H the server refuses it."""
    import shlex

    from aot.serving.supervision.admin_key import GRPC_ADMIN_HEADER

    text = (ROOT / "docs" / "serving.md").read_text()
    block = text.split("### Load with `perf_analyzer`", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    command = shlex.split(block.replace("\\\n", " "))
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "perf_analyzer" and (flags["-m"], flags["-i"]) == ("aot", "grpc")
    assert flags["-H"].startswith(f"{GRPC_ADMIN_HEADER}:") and flags["--input-data"] == "docs/perf_analyzer_input.json"


def test_input_data_has_the_documented_shape_and_mixes_tasks():
    from aot.benchmarks.gpu.load import input_data

    documented = json.loads((ROOT / "docs" / "perf_analyzer_input.json").read_text())["data"][0]
    data = input_data(["a", "b", "c"], ["t0", "t1"])["data"]
    assert {k: v["shape"] for k, v in data[0].items()} == {k: v["shape"] for k, v in documented.items()}
    assert [(e["TEXT"]["content"], e["TASK"]["content"]) for e in data] == [(["a"], ["t0"]), (["b"], ["t1"]),
                                                                           (["c"], ["t0"])]


def test_windows_run_what_the_targets_read_first():
    from aot.benchmarks.gpu.perf import windows_in_order

    order = [(w.model, w.texts, w.concurrency) for w in windows_in_order("base", (1, 32, 256), (1, 64))]
    assert len(order) == len(set(order)) == 18
    targeted = {(m, t, c) for m in ("vanilla", "aot-8") for t in (1, 64) for c in (32, 256)}
    assert set(order[:8]) == targeted and order[:3] == [("vanilla", 1, 32), ("aot-8", 1, 32), ("vanilla", 1, 256)]
    assert {w[2] for w in order[-6:]} == {1}  # no target reads c=1 on the base shape: its rows go last
    minilm = [(w.model, w.texts, w.concurrency) for w in windows_in_order("minilm", (1, 32, 256), (1, 64))]
    assert set(minilm[:10]) == targeted | {("vanilla", 1, 1), ("aot-8", 1, 1)}  # the p50 target's


def test_budget_skips_what_would_pass_the_deadline():
    import time

    from aot.benchmarks.gpu.load import Window
    from aot.benchmarks.gpu.perf import RESERVE_S, Budget

    unbounded = Budget(None, 10.0, 1500)
    assert unbounded.fits(1e9) and unbounded.estimate(Window("vanilla", 1, 1)) == 10.0
    assert unbounded.estimate(Window("vanilla", 1, 1), 3000) == 20.0  # a window twice as long: twice the guess
    budget = Budget(time.time() + RESERVE_S + 100, 10.0, 1500)
    budget.record(Window("vanilla", 64, 256), 30.0)
    budget.record(Window("vanilla", 64, 32), 20.0)
    assert budget.estimate(Window("aot-1", 64, 1)) == 30.0  # the longest of the same request size
    assert budget.estimate(Window("aot-1", 1, 1)) == 30.0  # none of its size yet: the longest of any
    assert budget.fits(50.0) and not budget.fits(150.0)
    budget.record(Window("aot-8", 64, 256), 120.0, 6000)  # 20 s a second of window: as long as the 1.5 s ones
    assert budget.estimate(Window("aot-1", 64, 256), 6000) == pytest.approx(120.0)
    budget.record(Window("aot-8", 64, 256), 160.0, 6000)  # longer than the rest for its window
    assert budget.estimate(Window("vanilla", 64, 32)) == pytest.approx(40.0)


def test_a_window_of_long_requests_is_measured_over_a_longer_interval():
    """Two requests' latency in a closed loop (texts x concurrency / texts per second), at least the given window, at
    most MAX_INTERVAL_MS."""
    from aot.benchmarks.gpu.load import MAX_INTERVAL_MS, Window, interval_ms

    assert interval_ms(Window("vanilla", 1, 256), 3000.0, 1500) == 1500  # 85 ms a request
    assert interval_ms(Window("vanilla", 64, 256), 7000.0, 1500) == 4681  # 2.3 s a request, as on the H100
    assert interval_ms(Window("vanilla", 64, 256), 1000.0, 1500) == MAX_INTERVAL_MS
    assert interval_ms(Window("vanilla", 64, 32), 7000.0, 1500) == 1500


def test_an_earlier_shape_keeps_time_for_the_later_shapes_target_windows():
    from aot.benchmarks.gpu.perf import RESERVE_S, Budget, kept_for_later

    budget = Budget(None, 10.0, 1500)

    def base_window(window):
        return 1500

    assert kept_for_later([], 30.0, budget, (1, 32, 256), (1, 64), base_window) == 0.0
    # base: set-up guessed at twice this shape's, then its 8 target windows (c=1 is a target of minilm's alone)
    assert kept_for_later(["base"], 30.0, budget, (1, 32, 256), (1, 64), base_window) == 2 * 30.0 + RESERVE_S + 80.0
    assert kept_for_later(["minilm"], 30.0, budget, (1, 32, 256), (1, 64), base_window) == 60.0 + RESERVE_S + 100.0
    # the later shape's 64-text windows at c=256 are foreseen longer (their own interval)
    assert kept_for_later(["base"], 30.0, budget, (1, 32, 256), (1, 64),
                          lambda w: 6000 if (w.texts, w.concurrency) == (64, 256) else 1500) == 60.0 + RESERVE_S + 140.0


def test_metric_sum_adds_every_series_and_tells_none_from_zero():
    from aot.benchmarks.gpu.server import metric_sum

    text = ('# TYPE aot_engine_eager_batches_total counter\n'
            'aot_engine_eager_batches_total{step="aot",instance="0"} 0\n'
            'aot_engine_eager_batches_total{step="aot",instance="1"} 3\n'
            'aot_engine_eager_batches_total_other 7\n')
    assert metric_sum(text, "aot_engine_eager_batches_total") == 3.0
    assert metric_sum(text.replace(" 3\n", " 0\n"), "aot_engine_eager_batches_total") == 0.0
    assert metric_sum("", "aot_engine_eager_batches_total") is None


def test_utilisation_samples_are_read_and_summarised_per_window():
    from aot.benchmarks.gpu.load import parse_utilisation, summarise_utilisation

    assert [parse_utilisation(line) for line in ("87\n", " 5 ", "[N/A]", "")] == [87.0, 5.0, None, None]
    samples = [(0.5, 10.0), (1.0, 60.0), (1.5, 80.0), (3.0, 100.0)]
    assert summarise_utilisation(samples, 1.0, 2.0) == {"gpu_util_mean": 70.0, "gpu_util_max": 80.0,
                                                        "gpu_util_samples": 2}
    assert summarise_utilisation(samples, 5.0, 6.0)["gpu_util_mean"] is None


def _perf_shape(name: str, **changes) -> dict:
    """A shape's record as aot bench gpu-perf writes it, every targeted window measured."""
    windows = []
    for model, rate in (("vanilla", 1.0), ("aot-1", 0.99), ("aot-8", 0.98)):
        for texts, engine_share in ((1, 0.4), (64, 0.85)):
            for c in (1, 32, 256):
                windows.append({"model": model, "texts": texts, "concurrency": c, "p50_ms": 2.5 if c == 1 else 20,
                                "texts_per_s": round(1000 * engine_share * rate, 1), "gpu_util_mean": 75.0})
    return {"name": name, "windows": windows, "engine_alone": {"vanilla_seq_per_s": 1000.0, "aot_seq_per_s": 1000.0},
            "eager_batches": {"measured": 0, "since_start": 0},
            "parity": {"texts": 8, "max_abs_logit_diff": 0.01, "same_label": "8/8"}, **changes}


def test_targets_are_evaluated_on_the_windows():
    from aot.benchmarks.gpu.report import evaluate_targets

    checks = {(c["shape"], c["target"]): c for c in evaluate_targets([_perf_shape("minilm"), _perf_shape("base")])}
    assert checks and all(c["met"] is True for c in checks.values()), [c for c in checks.values() if c["met"] is not True]
    single = checks[("minilm", "vanilla, 1-text requests, c=256: served / engine alone")]
    assert single["value"] == 0.4 and single["threshold"] == "≥ 0.15"  # issue 52's, by shape
    assert checks[("base", "vanilla, 1-text requests, c=256: served / engine alone")]["threshold"] == "≥ 0.333"
    assert checks[("minilm", "vanilla, 64-text requests, c=256: served / engine alone")]["threshold"] == "≥ 0.5"
    assert checks[("base", "vanilla, 64-text requests, c=256: served / engine alone")]["threshold"] == "≥ 0.8"
    assert checks[("base", "AoT 8 mixed / vanilla, 64-text requests, c=32")]["value"] == 0.98
    assert checks[("base", "AoT 8 mixed / vanilla, 1-text requests, c=1")]["threshold"] == "≥ 0.95"  # every point
    assert ("minilm", "vanilla, 1-text requests, c=1: p50 ms") in checks  # the p50 target is MiniLM's alone
    assert not any(target.endswith("c=1: p50 ms") for shape, target in checks if shape == "base")

    slow = _perf_shape("minilm")
    for w in slow["windows"]:
        if w["model"] == "aot-8" and w["concurrency"] == 256:
            w["texts_per_s"] = 300.0 if w["texts"] == 1 else w["texts_per_s"]
            w["gpu_util_mean"] = None if w["texts"] == 64 else w["gpu_util_mean"]
        if w["model"] == "vanilla" and w["texts"] == 64 and w["concurrency"] == 256:
            w.pop("texts_per_s")
            w["skipped"] = "~9 s would pass the deadline"
    checks = {c["target"]: c for c in evaluate_targets([slow])}
    assert checks["AoT 8 mixed / vanilla, 1-text requests, c=256"]["met"] is False
    assert checks["aot-8, 64-text requests, c=256: GPU utilisation %"]["met"] is None  # not measured
    assert checks["vanilla, 64-text requests, c=256: served / engine alone"]["met"] is None  # skipped
    assert checks["AoT 8 mixed / vanilla, 64-text requests, c=256"]["met"] is None  # its vanilla was skipped


@pytest.mark.parametrize("changes, device, said", [
    ({}, "cuda", None),
    ({"eager_batches": {"measured": 2, "since_start": 5}}, "cuda", "2 batch(es) ran eagerly"),
    ({"eager_batches": {"measured": None, "since_start": None}}, "cuda", "published no aot_engine_eager_batches"),
    ({"eager_batches": {"measured": None, "since_start": None},  # no CUDA graphs on cpu; fp32 there
      "parity": {"texts": 8, "max_abs_logit_diff": 2e-5, "same_label": "8/8"}}, "cpu", None),
    ({"parity": {"texts": 8, "max_abs_logit_diff": 0.4, "same_label": "6/8"}}, "cuda", "differ from aot predict"),
    ({"parity": {"texts": 8, "max_abs_logit_diff": 0.01, "same_label": "8/8"}}, "cpu", "differ from aot predict"),
    ({"error": "RuntimeError: aot serve exited with 1"}, "cuda", "aot serve exited with 1"),
])
def test_what_fails_the_check(changes, device, said):
    from aot.benchmarks.gpu.report import failures

    found = failures([_perf_shape("minilm", **changes)], device)
    assert (found == []) if said is None else (len(found) == 1 and said in found[0]), found


def test_perf_reports_are_written_with_targets_and_failures(tmp_path):
    from aot.benchmarks.gpu.report import write_reports

    shape = _perf_shape("minilm", description="bert config, 6 layers", eager_batches={"measured": 1, "since_start": 1},
                        elapsed_s={"windows": 12.0}, skipped=["aot-1-t64-c1 (~9 s would pass the deadline)"],
                        texts_note="64 reviews", gpu_instances=4, ready_seconds=9.5)
    shape["engine_alone"].update(batch=128, seq=64, cuda_graphs=True, vanilla_ms=2.4, aot_ms=2.5,
                                 aot_over_vanilla=1.03)
    result = {"device": "cuda", "device_name": "a GPU", "generator": "perf_analyzer", "started": "now",
              "elapsed_s": 99.0, "notes": ["a note"], "shapes": [shape]}
    write_reports(result, tmp_path)
    saved = json.loads((tmp_path / "perf.json").read_text())
    assert saved["failures"] and saved["targets"] == result["targets"]
    text = (tmp_path / "perf.md").read_text()
    assert "**The check FAILED:**" in text and "a note" in text and "**Skipped**: aot-1-t64-c1" in text
    assert "vanilla 2.400 ms = **1,000 seq/s**" in text  # the figures of the record
    assert "The served step in 4 instance(s) on the GPU; server ready in 9.5 s" in text


def test_py_spy_raw_stacks_are_summarised_and_reported(tmp_path):
    """py-spy's raw output (root first, a count a line) as the busy share and the frames with the most samples, own
    and inclusive; perf.md shows it with the shape, and a profile that failed says why."""
    from aot.benchmarks.gpu.report import profile_markdown
    from aot.benchmarks.gpu.step_profile import summarise

    raw = ("execute (model.py:54);encode (tokenization.py:78) 60\n"
           "execute (model.py:54);logits (tasks.py:188) 25\n"
           "_publish (step_metrics.py:263) 15\n"
           "not a stack line\n")
    summary = summarise(raw, seconds=1.0, rate=200)
    assert (summary["samples"], summary["expected_samples"], summary["busy_share"]) == (100, 200, 0.5)
    assert summary["leaf"][0] == {"frame": "encode (tokenization.py:78)", "share_of_samples": 0.6}
    assert summary["inclusive"][0] == {"frame": "execute (model.py:54)", "share_of_samples": 0.85}
    assert summarise("", 1.0, 200) == {"samples": 0, "expected_samples": 200, "busy_share": 0.0, "leaf": [],
                                       "inclusive": []}
    text = profile_markdown({"window": "aot-8-t64-c256", "pid": 42, "rate": 200, "seconds": 1.0, "raw": "py-spy.txt",
                             **summary})
    assert "pid 42) through aot-8-t64-c256: 100 samples of 200 (50% of the time busy" in text
    assert "| encode (tokenization.py:78) | 60.0 | execute (model.py:54) | 85.0 |" in text
    assert "failed (py-spy exited with 1" in profile_markdown({"window": "w", "error": "py-spy exited with 1: no"})
    assert profile_markdown(None) == ""
