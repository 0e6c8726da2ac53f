"""Many tasks: how serving scales with the number of tasks, and the task store under them.

    modes      `aot bench tasks`: fused tables, factors and the task pool side by side at each task count
    scale      `aot bench tasks --scale`: one server and ever more tasks, as `aot serve` runs them (DerivedStore:
               tasks derived from one trained task)
    scale_cold cold first requests of tasks no draw names, factored and fused, idle and under load
    scale_report  its reports: scale.json (every record, each run's figures), scale.md, scale.png
    version_policies  the host version cache's policy against LRU, replayed on the bench's traffic
    s3_store   `aot bench s3`: the task store in object storage against the file system
    hardening  `aot bench hardening`: issue 46's figures: a hung store, unknown tasks, a damaged shard, a large change
"""
