"""The host's version cache policy against least recently used, replayed in process (aot.serving.store.admission:
the code the host cache runs) on two kinds of traffic, with the scale bench's version size and the host's bound:

    cyclic   the versions of a working set 10 % larger than the cache, asked in turn, 20 times round: LRU evicts
             each version just before it is asked for again (no hit at all)
    zipf     the scale bench's draws over its tasks: its warm-up and its steady pass (the same draws again), and a
             long stream of new draws

Records: trace, policy, requests, versions the cache holds, hit rate (the steady pass's alone for `zipf steady`).
"""

from __future__ import annotations

import numpy as np

from aot.serving.store.admission import POLICIES, make_policy, replay


def replay_version_policies(version_bytes: int, cache_bytes: int, tasks: int, draws: np.ndarray,
                            stream: int = 20000, seed: int = 0) -> list[dict]:
    """`draws`: the scale bench's warm-up draws (task numbers; its steady pass replays them)."""
    capacity = max(1, cache_bytes // version_bytes)
    cycle = [f"v{i}" for _ in range(20) for i in range(int(capacity * 1.1) + 1)]
    warm = [f"v{int(k)}" for k in draws]
    weights = 1.0 / np.arange(1, tasks + 1)
    fresh = [f"v{int(k)}" for k in np.random.default_rng(seed).choice(tasks, size=stream, p=weights / weights.sum())]
    slots = 4 * (capacity + 1) + 16
    records = []
    for policy in POLICIES:
        for trace, names in (("cyclic (1.1x the cache)", cycle), ("zipf stream", fresh)):
            result = replay(make_policy(policy, slots, cache_bytes), names, version_bytes)
            records.append({"trace": trace, "policy": policy, "requests": len(names), "capacity": capacity,
                            "hit_rate": result["hit_rate"]})
        both = replay(make_policy(policy, slots, cache_bytes), warm + warm, version_bytes)
        first = replay(make_policy(policy, slots, cache_bytes), warm, version_bytes)
        records.append({"trace": "zipf steady (warm-up replayed)", "policy": policy, "requests": len(warm),
                        "capacity": capacity,
                        "hit_rate": round((both["hits"] - first["hits"]) / max(len(warm), 1), 4)})
    return records
