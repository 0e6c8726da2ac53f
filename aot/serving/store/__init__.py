"""The task store: the tasks a repository serves, read and written in this room alone (format `aot-task-store` v5,
docs/formats.md): the exporter publishes through its writer, every served step and tool reads through its reader. It
imports nothing of the request path's steps nor of the supervision room (pyproject.toml [tool.importlinter]).

    layout        the names of the store's files and folders, and of a version folder's files (task.json, ...)
    reader        the store as readers see it: StoreReader, its index (StoreIndex), names, versions, storages
    writer        the store as its publisher writes it: TaskStore (create, publish, remove, clean, verify)
    entry_history the versions an entry keeps, retires and expires (the writer's rules)
    compatibility what a new current version may change: labels, kind and pair-ness only when allowed
    version_admin `aot export versions | rollback | route`
    tenant_admin  `aot export tenant create | rotate | delete | list`
    repair        `aot export repair`: the index rebuilt from what still reads
    lost_changes  what a repair discards, in words (a damaged log's change, as far as it reads)
    backend       where a store's objects live: a folder (local, or a volume a fleet shares) or a bucket
    s3            the S3-compatible backend (`s3://BUCKET/PREFIX`)
    version_cache task versions fetched from a remote store into a bounded local folder, kept across restarts
    log           the index as an append-only change log: a publish costs what it changes
    parts         a large change set of the log in parts of bounded size
    shards        entries compacted into 256 shards by name, read one shard at a time
    entries       an index's entries, each parsed and checked on its first use
    view          a reader's index that follows the change log: what steps and the audit read
    mirror        what this host last read of a remote store's index, served while the store cannot be reached
    digests       digests of a version's files: written at publish, checked when a version is loaded
    sealed        a version's files copied into sealed memory and checked there: what requests read
    table_blocks  a fused table's block digests: its rows read and hashed by blocks, never trusted by a stamp
    host_cache    one cache of sealed versions per host, shared by its step processes, bounded for the host
    admission     which versions a host keeps: W-TinyLFU (scan-resistant), and LRU to compare
    rechecks      refused versions checked again, backed off, so that a restored version serves again
    audit         every current version's files checked against their digests in the background
    tenants       task namespaces TENANT/TASK that answer only requests carrying the tenant's key
    names         an index's task names by tenant, sorted: an unknown task's suggestions at a bounded cost
    atomic        writing files and folders so that readers see the old or the new one, never half
    check         whether a server's store can serve any task: what the supervisor's /ready waits for
"""
