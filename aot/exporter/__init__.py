"""Export: a trained task into a served repository. Fuses P (or keeps its factors), writes the shared backbone (ONNX,
int8 twins, TensorRT profiles, or the torch engine), the Triton configs, and writes each task into a version folder,
validates it and publishes it through the task store's writer (aot.serving.store.writer: the store's format is
written there alone).

    backbone_export `aot export backbone`: the shared encoder into a new repository
    onnx_export     the encoder as ONNX, with AoT bias inputs ("aot") or without ("vanilla"), and its validation
    quantize        int8 twins of the graphs for the CPU configs
    torch_export    the torch engine's backbone, checked through the engine that will serve it
    tensorrt        TensorRT optimization profiles, the trtexec command, a build through the Python API
    configs         the Triton model configs, generated from one source
    config_checks   what Triton checks only at load time, checked at export
    compose_env     REPO/compose.env for docker compose: memory pools sized from the largest batch
    task_export     `aot export task`: fuse, validate, publish one task
    task_validation a task checked against its repository before it is published (backbone, kinds, served answers)
    batch_export    many tasks published together (`--batch`)
    task_record     a trained task in the served format: task.json and the head's arrays
    rows_export     the rows graphs of a store: factored rows computed by ONNX Runtime
    version_check   a published version loaded as a server loads it (`aot export verify | repair`)
    cpu_engine      a repository's CPU engine in process: what the served CPU step computes, without a server
    accuracy_gate   a task is scored through the int8 engine before it is published onto int8 graphs
"""
