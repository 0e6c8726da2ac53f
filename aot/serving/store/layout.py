"""The names of the task store's files and folders (format `aot-task-store` v5, docs/formats.md), each spelled here
once: what the writer writes, the reader reads and the exporter fills a version folder with.

    REPO/tasks/                        the store's folder (or, for the index and versions, s3://BUCKET/PREFIX)
        store.json                     STORE_FILE: the store's identity (aot.serving.store.reader)
        log/, index/, shards/, parts/  LOG, INDEX, SHARDS, PARTS: the index (aot.serving.store.log)
        generation                     GENERATION: the newest generation, a hint readers poll
        embeddings.npy                 EMBEDDINGS: the backbone's embedding matrix (factored FC tasks)
        rows/<formula>.onnx            ROWS_DIR: the rows graphs factored tasks are computed with
        <name>@<id>/                   a version folder (aot.serving.store.reader.folder_name), immutable:
            task.json                  TASK_JSON: kind, labels, metric, storage, method, shapes (aot.serving.tasks)
            head.safetensors           HEAD: a head's arrays (none for an embedding task)
            table.npy                  TABLE: a fused task's P, [V, L, d] fp16
            table.blocks               TABLE_BLOCKS: the digests of its blocks (aot.serving.store.table_blocks)
            factors.safetensors        FACTORS: a factored task's P factors
        .staging/                      STAGING: versions being written, hidden from readers
        .lock                          LOCK: the writers' lock
        manifest.json                  V1_MANIFEST: format v1's index, read only to upgrade it
"""

from __future__ import annotations

# a version folder's files
TASK_JSON = "task.json"
HEAD = "head.safetensors"
TABLE = "table.npy"
TABLE_BLOCKS = "table.blocks"
FACTORS = "factors.safetensors"

# the store's folder
STORE_FILE = "store.json"
EMBEDDINGS = "embeddings.npy"
ROWS_DIR = "rows"
STAGING = ".staging"
LOCK = ".lock"
LEGACY_STAGING_PREFIX = ".tmp-"  # folders writers from before STAGING left in the store's folder: debris
V1_MANIFEST = "manifest.json"

# the index's objects
LOG = "log"
INDEX = "index"
SHARDS = "shards"
PARTS = "parts"
GENERATION = "generation"
