"""The ground floor: what the served Triton steps and the client need, and nothing above it.

It imports nothing from `training`, `exporter`, `benchmarks` or `aot`, and not torch: the Triton image installs
only this package's extra (`.[serve]`). Training and export build on it (they write what it reads).

    protocol     the tensors between the client and the served steps (one definition of names and dtypes)
    atomic       writing files and folders so that readers see the old or the new one, never half
    formats      the one reader of versioned JSON files (every format carries a name and a version)
    store        the task store reader: manifest, entries, version folders
    repository   the repository record reader and the serving options
    tasks        a served task version: its folder loaded and verified, its rows (fused table or factors), its head
    task_registry  the task versions of the store as a step sees them: names resolved, versions kept, rows pooled
    tokenization text -> token ids, as in training (the `tokenizers` library, no transformers/torch)
    engine       the backbone engines by name (a registry other packages fill: serving_torch registers `torch` when
                 imported), the request data they take (Prepared), and ONNX Runtime's runner (`onnx`)
    pool         the task pool: rows of P in one preallocated buffer, resident or cached
    steps        what every Triton python step shares: input checks, one response per request, metrics
    stages       what the served steps compute: TextInputs, Encoder, head_answers
"""
