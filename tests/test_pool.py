"""The task pool: accounting, eviction and refill, versions, and serving through it (real server)."""

import re
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from aot.serving.pool import POLICIES, RowPool

V, L, D = 500, 2, 4


def _tables(n, seed=0):
    rng = np.random.default_rng(seed)
    return {f"t{i}@{i:012x}": rng.standard_normal((V, L, D)).astype(np.float16) for i in range(n)}


def _attach(pool, tables):
    for version, table in tables.items():
        pool.attach(version, lambda ids, t=table: t[ids])


def test_every_task_resident_while_all_fit():
    tables = _tables(3)
    pool = RowPool(3 * V * L * D * 2, L, D, V)
    _attach(pool, tables)
    rng = np.random.default_rng(1)
    started = time.perf_counter()
    asked = {version: set() for version in tables}
    for _ in range(50):
        version = list(tables)[rng.integers(3)]
        ids = np.unique(rng.integers(0, V, 40))
        asked[version] |= set(ids.tolist())
        np.testing.assert_array_equal(pool.rows_many([(version, ids)])[0], tables[version][ids])
    elapsed = time.perf_counter() - started
    assert pool.resident and set(pool.stats) == set(tables)
    for version, stats in pool.stats.items():  # each row filled the first time a request read it, never again
        assert stats.evictions == 0 and stats.resident_rows == stats.misses == len(asked[version]) < V
    assert all(0 < s.fill_seconds <= elapsed for s in pool.stats.values())  # the fill's own time, in seconds


@pytest.mark.parametrize("resident", [True, False])
def test_a_batch_fills_each_versions_missing_rows_in_one_call(resident):
    """16 items of one cold task and 4 of another in one batch: one call of each version's source, for the union of
    their missing rows (a factored task's rows graph runs once per batch, not per item), and every item its rows."""
    tables = _tables(2)
    pool = RowPool((2 if resident else 1) * V * L * D * 2, L, D, V)
    calls: dict[str, list[int]] = {version: [] for version in tables}
    for version, table in tables.items():
        pool.attach(version, lambda wanted, v=version, t=table: calls[v].append(len(wanted)) or t[wanted])
    first, second = list(tables)
    rng = np.random.default_rng(3)
    batch = [(first, np.unique(rng.integers(0, V, 12))) for _ in range(16)]
    batch += [(second, np.unique(rng.integers(0, V, 12))) for _ in range(4)]
    rows = pool.rows_many(batch)
    assert pool.resident is resident
    for (version, ids), got in zip(batch, rows, strict=True):
        np.testing.assert_array_equal(got, tables[version][ids])
    for version in tables:
        union = np.unique(np.concatenate([ids for v, ids in batch if v == version]))
        assert calls[version] == [len(union)], calls  # one fill, of exactly the rows missing


@pytest.mark.parametrize("resident", [True, False])
def test_a_version_let_go_keeps_its_rows_and_detaches_whole(resident):
    """let_go keeps a version's rows (its next source fills only what is missing); detach then drops them all, its
    stats with them, and a version attached again starts from nothing."""
    tables = _tables(3)
    pool = RowPool((3 if resident else 1) * V * L * D * 2, L, D, V)
    _attach(pool, tables)
    a, ids = next(iter(tables)), np.arange(0, 200, 3)
    pool.rows_many([(a, ids)])
    pool.let_go(a)
    assert pool.holds(a) and pool.resident == resident
    pool.attach(a, lambda i: tables[a][i])
    misses = pool.stats[a].misses
    np.testing.assert_array_equal(pool.rows_many([(a, ids)])[0], tables[a][ids])
    assert pool.stats[a].misses == misses  # every row was still there
    pool.let_go(a)
    pool.detach(a)
    assert not pool.holds(a) and a not in pool.stats and a in pool.snapshot()[0]
    pool.attach(a, lambda i: tables[a][i])
    np.testing.assert_array_equal(pool.rows_many([(a, ids)])[0], tables[a][ids])
    assert pool.stats[a].resident_rows == len(ids) and pool.stats[a].misses == len(ids)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dense_share", [0.0, 1 / 64, 2.0])  # slots in arrays at once, past 1/64 of V, never
def test_cache_never_exceeds_budget_and_refills_identical_rows(policy, dense_share, monkeypatch):
    """A random trace through a pool of 2 tables' rows for 6: every row as stored, whatever evicted and refilled,
    the slots found through dicts, arrays, or a version's switch from one to the other."""
    from aot.serving import pool as pool_module

    monkeypatch.setattr(pool_module, "DENSE_SHARE", dense_share)
    tables = _tables(6)
    pool = RowPool(2 * V * L * D * 2 + 5, L, D, V, policy)  # room for 2 of 6 tables (and part of a row: ignored)
    assert pool.slots == 2 * V and pool.budget_bytes == 2 * V * L * D * 2
    _attach(pool, tables)
    assert not pool.resident
    rng = np.random.default_rng(2)
    versions = list(tables)
    for _ in range(300):
        batch = [(versions[rng.integers(6)], np.unique(rng.zipf(1.3, 60) % V)) for _ in range(8)]
        for (version, ids), rows in zip(batch, pool.rows_many(batch), strict=True):
            np.testing.assert_array_equal(rows, tables[version][ids])  # including rows evicted and refilled
        held = (pool._owner >= 0).sum()
        assert held <= pool.slots and held == sum(s.resident_rows for s in pool.stats.values())
    stats = pool.stats.values()
    assert sum(s.evictions for s in stats) > 0 and sum(s.hits for s in stats) > sum(s.misses for s in stats)
    arrays = sum(isinstance(t, np.ndarray) for t in pool._slot_of.values())
    assert arrays == (0 if dense_share > 1 else len(pool._slot_of)) or 0 < dense_share < 1, (dense_share, arrays)


def test_detached_version_rows_are_dropped_and_never_served_for_another():
    old, new = _tables(1, seed=3), _tables(1, seed=4)
    old_version = next(iter(old))
    pool = RowPool(V * L * D * 2 // 2, L, D, V)
    _attach(pool, old)
    ids = np.arange(0, V, 7)
    pool.rows_many([(old_version, ids)])
    pool.detach(old_version)
    assert pool.stats == {} and (pool._owner >= 0).sum() == 0
    replacement = "t0@0000000000ff"
    pool.attach(replacement, lambda i: new[old_version][i])
    np.testing.assert_array_equal(pool.rows_many([(replacement, ids)])[0], new[old_version][ids])


def test_lfu_keeps_rows_used_often_where_lru_keeps_the_last_used():
    """A hot set of tokens used every third batch among tokens used once (a scan), 64 slots: LFU keeps the hot
    set, LRU lets it go."""
    table = _tables(1)
    version = next(iter(table))
    hot = np.arange(0, 20)
    hits = {}
    for policy in POLICIES:
        pool = RowPool(64 * L * D * 2, L, D, V, policy)
        _attach(pool, {version: table[version], "other@000000000001": table[version]})
        scan = (100 + 30 * k + np.arange(30) for k in range(12))  # rows used once: 60 between two hot batches
        for batch in range(18):
            ids = hot if batch % 3 == 0 else next(scan)
            before = pool.stats[version].hits
            np.testing.assert_array_equal(pool.rows_many([(version, ids)])[0], table[version][ids])
            if batch % 3 == 0 and batch:
                hits[policy] = hits.get(policy, 0) + pool.stats[version].hits - before
    # LRU keeps only what the last eviction happened to spare (4 rows); LFU loses the hot set once, at its first
    # eviction (every token was used once then), and keeps it from its second use on
    assert hits == {"lru": 5 * 4, "lfu": 4 + 4 * len(hot)}, hits


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_the_host_buffer_is_kept_out_of_huge_pages():
    """A task's first rows land scattered over its range: in a huge page each first write would zero 2 MiB. The
    buffer's mapping carries the kernel's no-huge-pages flag (VmFlags nh), and it holds what was written."""
    pool = RowPool(64 << 20, num_layers=2, hidden_size=8, vocab_size=1000)
    start = pool.buffer.__array_interface__["data"][0]
    flags, current = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            current = int(head.group(1), 16) <= start < int(head.group(2), 16)
        elif current and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    assert flags is not None, "the buffer's mapping is not in /proc/self/smaps"
    assert "nh" in flags, flags
    pool.attach("t@1", lambda wanted: np.full((len(wanted), 2, 8), 3, np.float16))
    slots = pool.slots_many([("t@1", np.array([5, 999]))])
    assert (pool.buffer[slots[0]] == 3).all()


def test_one_batch_larger_than_the_pool_is_refused():
    pool = RowPool(10 * L * D * 2, L, D, V)
    tables = _tables(2)
    _attach(pool, tables)
    with pytest.raises(ValueError, match="pool policy 'fifo': expected one of lru, lfu"):
        RowPool(10 * L * D * 2, L, D, V, "fifo")
    with pytest.raises(MemoryError, match="raise --pool-bytes"):
        pool.rows_many([(v, np.arange(20)) for v in tables])


@pytest.mark.server
@pytest.mark.parametrize("engine,instances", [("onnx", 1), ("onnx", 2), ("torch", 2)])
def test_served_through_a_small_pool_equals_predict(tmp_path_factory, tiny_models, sentiment_dir, engine, instances):
    """Cache mode through the real server: a pool of 24 rows for 3 tasks (fused and factored), in host memory
    (ONNX Runtime step) or beside the torch engine, whose forward gathers from it in place. With 2 instances of the
    fused step each holds half the budget, and in host memory the fused table is then read through its memory map
    (shared by the instances through the page cache): only the factored rows are pooled."""
    from aot.client.client import Client
    from aot.local.server import LocalServer
    from aot.serving.repository import read_repository
    from aot.serving.steps import StepMetrics
    from aot.training.predict import Predictor
    from tests.helpers import make_repository, train_tiny_task

    root = tmp_path_factory.mktemp("pool")
    artifacts = {n: train_tiny_task(tiny_models["bert"], sentiment_dir, root / n, m, seed=s, epochs=1)
                 for n, m, s in (("a", "fc", 0), ("b", "kron", 1), ("c", "fc", 2))}
    repo = make_repository(tiny_models["bert"], root / "repo", {"a": (artifacts["a"], "fused"),
                                                                "b": (artifacts["b"], "factored"),
                                                                "c": (artifacts["c"], "factored")},
                           engine=engine, cpu_instances=instances)
    info = read_repository(repo)
    budget = 24 * info.num_layers * info.hidden_size * 2  # 24 rows for 3 tasks: most tokens get evicted
    texts = ["good w1 w2", "w3 awful w4 w5 the movie", "superb plot w7 w8 w9", "dull w10 w11", "w12 w13 great"]
    expected = {n: Predictor.load(a).logits(texts).numpy() for n, a in artifacts.items()}
    errors, wrong = [], []
    with LocalServer(repo, pool_bytes=budget) as server:
        def worker(k):
            with Client(server.grpc_url) as c:
                for j in range(60):
                    name, i = "abc"[(k + j) % 3], (k * 3 + j) % len(texts)
                    try:
                        got = np.array(c.infer(name, texts[i])["logits"])
                    except Exception as exc:  # noqa: BLE001
                        errors.append(repr(exc))
                        continue
                    if np.abs(got - expected[name][i]).max() > 1e-3:
                        wrong.append((name, i))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # the steps publish counters at most once a second, after a batch: wait that long, then send one request
        time.sleep(StepMetrics.FLUSH_SECONDS + 0.2)
        with Client(server.grpc_url) as c:
            c.infer("a", texts[0])
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    assert errors == [] and wrong == []
    evictions = sum(float(v) for v in re.findall(r'^aot_pool_evictions_total\{[^}]*\} (\S+)', metrics, re.M))
    hits = sum(float(v) for v in re.findall(r'^aot_pool_hits_total\{[^}]*\} (\S+)', metrics, re.M))
    assert evictions > 0 and hits > 0, [line for line in metrics.splitlines() if "aot_pool" in line]
    assert re.search(r'aot_pool_resident_bytes\{[^}]*task="b"', metrics)
    fused_pooled = re.search(r'aot_pool_resident_bytes\{[^}]*task="a"', metrics)
    assert bool(fused_pooled) == (engine == "torch" or instances == 1), [
        line for line in metrics.splitlines() if "resident" in line]
    instances_seen = set(re.findall(r'^aot_pool_hits_total\{[^}]*instance="(aot_0_\d)"', metrics, re.M))
    assert instances_seen <= {f"aot_0_{k}" for k in range(instances)} and instances_seen, instances_seen


def test_a_detached_version_never_shifts_the_others():
    """Resident mode: detaching A must not move B's rows (B would be served A's leftover rows)."""
    pool = RowPool(3 * V * L * D * 2, L, D, V)
    a = np.ones((V, L, D), np.float16)
    b = np.full((V, L, D), 2, np.float16)
    c = np.full((V, L, D), 3, np.float16)
    pool.attach("a@000000000000", lambda i: a[i])
    pool.attach("b@000000000000", lambda i: b[i])
    ids = np.array([1, 2, 3])
    pool.rows_many([("a@000000000000", ids), ("b@000000000000", ids)])
    pool.detach("a@000000000000")
    np.testing.assert_array_equal(pool.rows_many([("b@000000000000", ids)])[0], b[ids])
    pool.attach("c@000000000000", lambda i: c[i])  # takes A's range, filled afresh
    got = pool.rows_many([("c@000000000000", ids), ("b@000000000000", ids)])
    np.testing.assert_array_equal(got[0], c[ids])
    np.testing.assert_array_equal(got[1], b[ids])
    assert pool.resident
