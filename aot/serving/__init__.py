"""The ground floor: what the served Triton steps and the client need, and nothing above it.

It imports nothing from aot.training, aot.exporter, aot.benchmarks or the command, and not torch: the Triton image
installs only this package's extra (`.[serve]`). Training and export build on it (they write what it reads). Two
rooms beside the request path, independent of each other: `store` (the task store) and `supervision` (a running
server's supervisor); `python3 -m aot.serving` (__main__) is the container's entry point that joins them.

The request path, a request's way through a step:
    protocol       the tensors between the client and the served steps (one definition of names and dtypes)
    limits         how large one request may be, from the repository's serving options
    steps          what every Triton python step shares: its configuration, one response per request, metrics
    bytes_tensors  BYTES tensors read and written without the python backend's per-element Python
    columns        a request's inputs read as columns (the N texts or sequences it carries) and their checks
    stages         what the served steps compute on a batch: TextInputs, Encoder, the rows of P (find_rows)
    tokenization   text -> token ids, as in training (the `tokenizers` library, no transformers/torch)
    words          a token task's words: where each starts, and the entities its tags spell
    engine         the backbone engines by name (serving_torch registers `torch` when imported), the batch they
                   take (EncoderBatch) and give back (EncoderOutput), and ONNX Runtime's runner (`onnx`)
    task_registry  the task versions a step serves: names resolved through the store, versions loaded and kept
    loaded_versions the versions one step process holds: over the host's sealed copies, refusals checked again
    remote_fetches when a version is fetched from an object store, and how long its request waits for it
    rate_limits    per-caller request rates (a tenant, or every request without a key), and refused keys counted
    tasks          a served task version: its folder loaded and verified, its rows (fused or factored), its head
    pool           the task pool: rows of P in one preallocated buffer, resident or cached
    heads          the head stage: each item's task head by its kind, its LOGITS and LABEL for a whole batch
    outputs        a batch's answers as each request's output tensors (ANSWER only when asked for)
    kinds          the kinds of task in one registry: each kind's spec (its head, labels, metrics, answer, LABEL)
    answers        what the kinds' answers are made of (one rule for the server, `aot predict`, the client)
    errors         what a failed request answers: the error and its status
    repository     the repository record and its serving options
    formats        the one reader of versioned JSON files and JSON lines
    step_metrics   per-task metrics of a step (the busiest tasks by name: metric_labels)
    metric_labels  which tasks get metric series of their own
    request_log    the optional request log, one JSON line per sampled request
    shm            the python backend's shared-memory regions, private to the server's user
    watch          each step instance says when its current batch began (read by the supervisor)
"""
