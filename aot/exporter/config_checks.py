"""Checks of a generated model repository's configs that Triton (and its native backends) apply only at load time,
on a server that may be a GPU machine away: run at export, so that a repository that would not load is not written.

Each config is parsed as a Triton ModelConfig protobuf, then:
- batching: ragged inputs and batch inputs need max_batch_size > 0; a ragged input is 1-D ([-1]);
- batch inputs: a known kind with the source inputs it needs, source inputs that are ragged inputs of the model,
  INT32 or FP32, a target name no input has;
- CUDA graph specs (TensorRT): batch sizes within max_batch_size above their lower bounds (a spec without one is its
  own), and a shape for every input and batch input, no dimension below 0, that fits the input's dims (a ragged
  input's: one dimension), at or above its lower bound;
- native ONNX Runtime models: every config input, batch input and output matches the graph's (name, type, and rank:
  a ragged input is 1-D in the graph, a batched one has the batch axis first);
- ensembles: every step's model exists, maps only inputs and outputs that model has, and every tensor a step reads
  is an ensemble input or written by an earlier step, with the same data type.
"""

from __future__ import annotations

from pathlib import Path

from aot.exporter.configs import parse_pbtxt

_ONNX_TYPES = {1: "TYPE_FP32", 10: "TYPE_FP16", 6: "TYPE_INT32", 7: "TYPE_INT64", 8: "TYPE_STRING"}


class ConfigError(ValueError):
    pass


def _pb():
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def _dtype(value: int) -> str:
    return _pb().DataType.Name(value)


def load_configs(models: Path, config_name: str = "config.pbtxt") -> dict:
    """Every model's config (`config_name` under the model folder, e.g. configs/cpu.pbtxt, falling back to
    config.pbtxt as Triton does)."""
    out = {}
    for folder in sorted(p for p in models.iterdir() if (p / "config.pbtxt").is_file()):
        path = folder / config_name if (folder / config_name).is_file() else folder / "config.pbtxt"
        try:
            out[folder.name] = parse_pbtxt(path.read_text())
        except Exception as exc:  # noqa: BLE001 - text_format's errors name the line
            raise ConfigError(f"{path}: not a Triton ModelConfig: {exc}") from None
    return out


def _check_batching(name: str, config) -> list[str]:
    pb = _pb()
    problems = []
    ragged = {i.name for i in config.input if i.allow_ragged_batch}
    for i in config.input:
        if i.allow_ragged_batch and list(i.dims) != [-1]:
            problems.append(f"{name}: ragged input {i.name} has dims {list(i.dims)}, expected [-1]")
    if (ragged or config.batch_input) and config.max_batch_size <= 0:
        problems.append(f"{name}: ragged and batch inputs need max_batch_size > 0")
    inputs = {i.name for i in config.input}
    for b in config.batch_input:
        kind = pb.BatchInput.Kind.Name(b.kind)
        if len(b.target_name) != 1 or b.target_name[0] in inputs:
            problems.append(f"{name}: batch input {list(b.target_name)} needs one target name that is not an input")
        if b.data_type not in (pb.TYPE_INT32, pb.TYPE_FP32):
            problems.append(f"{name}: batch input {list(b.target_name)} is {_dtype(b.data_type)}, expected "
                            "TYPE_INT32 or TYPE_FP32")
        if kind != "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE" and len(b.source_input) != 1:
            problems.append(f"{name}: batch input {kind} needs exactly one source input")
        for source in b.source_input:
            if source not in ragged:
                problems.append(f"{name}: batch input {list(b.target_name)} reads {source!r}, which is not a ragged "
                                "input of the model")
    return problems


def _check_graph_specs(name: str, config) -> list[str]:
    """What the TensorRT backend validates when it captures CUDA graphs at load (InitializeGraphSpecs,
    ValidateGraphSpec), and the shapes SetCudaGraphShape needs for every engine input, batch inputs included (a spec
    lacking one is not captured). A spec without graph_lower_bound is its own lower bound; a ragged input's shape is
    its 1-D shape after the batch is concatenated."""
    problems = []
    inputs = {i.name: i for i in config.input}
    engine_inputs = set(inputs) | {b.target_name[0] for b in config.batch_input if len(b.target_name) == 1}
    for k, spec in enumerate(config.optimization.cuda.graph_spec):
        where = f"{name}: graph_spec {k} (batch {spec.batch_size})"
        lower = spec.graph_lower_bound if spec.HasField("graph_lower_bound") else spec
        if not 1 <= lower.batch_size <= spec.batch_size <= config.max_batch_size:
            problems.append(f"{where}: expected 1 <= lower bound batch {lower.batch_size} <= batch <= "
                            f"max_batch_size {config.max_batch_size}")
        if set(spec.input) != engine_inputs:
            problems.append(f"{where}: shapes for {sorted(spec.input)}, expected every input {sorted(engine_inputs)}")
        for tensor, shape in spec.input.items():
            dims = list(shape.dim)
            low = list(lower.input[tensor].dim) if tensor in lower.input else None
            if any(d < 0 for d in dims + (low or [])):
                problems.append(f"{where}: {tensor} {dims} (lower bound {low}) has a dimension below 0")
            if tensor in inputs and inputs[tensor].allow_ragged_batch:
                if len(dims) != 1:
                    problems.append(f"{where}: ragged {tensor} needs one dimension (its concatenated length), got "
                                    f"{dims}")
            elif tensor in inputs and (len(dims) != len(inputs[tensor].dims) or any(
                    c != -1 and c != d for c, d in zip(inputs[tensor].dims, dims, strict=True))):
                problems.append(f"{where}: {tensor} {dims} does not fit its dims {list(inputs[tensor].dims)}")
            if low is None or len(low) != len(dims) or any(lo > d for lo, d in zip(low, dims, strict=True)):
                problems.append(f"{where}: {tensor} needs a lower bound of rank {len(dims)} at most {dims}, got {low}")
    return problems


def _check_onnx_graph(name: str, config, graph_path: Path) -> list[str]:
    import onnx

    graph = onnx.load(str(graph_path), load_external_data=False).graph
    shapes = {v.name: (v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim))
              for v in list(graph.input) + list(graph.output)}
    problems = []
    expected = [(i.name, i.data_type, 1 if i.allow_ragged_batch else 1 + len(i.dims)) for i in config.input]
    expected += [(b.target_name[0], b.data_type, 1) for b in config.batch_input]
    expected += [(o.name, o.data_type, 1 + len(o.dims)) for o in config.output]
    for tensor, dtype, rank in expected:
        if tensor not in shapes:
            problems.append(f"{name}: {tensor!r} is not an input or output of {graph_path.name}")
            continue
        got_type, got_rank = shapes[tensor]
        if _ONNX_TYPES.get(got_type) != _dtype(dtype) or got_rank != rank:
            problems.append(f"{name}: {tensor!r} is {_dtype(dtype)} of rank {rank} in the config but "
                            f"{_ONNX_TYPES.get(got_type, got_type)} of rank {got_rank} in {graph_path.name}")
    graph_inputs = {v.name for v in graph.input} - {init.name for init in graph.initializer}
    fed = {t for t, _, _ in expected}
    for missing in sorted(graph_inputs - fed):
        problems.append(f"{name}: graph input {missing!r} is not fed by the config")
    return problems


def _check_ensemble(name: str, config, configs: dict) -> list[str]:
    problems = []
    available = {i.name: i.data_type for i in config.input}
    for step in config.ensemble_scheduling.step:
        model = configs.get(step.model_name)
        if model is None:
            problems.append(f"{name}: step {step.model_name!r} is not a model of the repository")
            continue
        inputs = {i.name: i.data_type for i in model.input}
        outputs = {o.name: o.data_type for o in model.output}
        for key, tensor in step.input_map.items():
            if key not in inputs:
                problems.append(f"{name}: {step.model_name} has no input {key!r}")
            elif tensor not in available:
                problems.append(f"{name}: {step.model_name}.{key} reads {tensor!r}, which nothing before it writes")
            elif available[tensor] != inputs[key]:
                problems.append(f"{name}: {step.model_name}.{key} is {_dtype(inputs[key])} but {tensor!r} is "
                                f"{_dtype(available[tensor])}")
        optional = {i.name for i in model.input if i.optional}
        for key in sorted(set(inputs) - set(step.input_map) - optional):
            problems.append(f"{name}: {step.model_name}.{key} is required and not mapped")
        for key, tensor in step.output_map.items():
            if key not in outputs:
                problems.append(f"{name}: {step.model_name} has no output {key!r}")
            else:
                available[tensor] = outputs[key]
    for o in config.output:
        if o.name not in available:
            problems.append(f"{name}: output {o.name!r} is written by no step")
    return problems


def check_configs(models: Path, config_name: str = "config.pbtxt") -> list[str]:
    """Every problem of the repository's configs under `config_name` (empty: Triton will accept them)."""
    configs = load_configs(models, config_name)
    problems = []
    for name, config in configs.items():
        if config.platform == "ensemble":
            problems += _check_ensemble(name, config, configs)
            continue
        problems += _check_batching(name, config)
        problems += _check_graph_specs(name, config)
        native = {"onnxruntime_onnx": config.default_model_filename or "model.onnx",
                  "tensorrt_plan": "model.raw.onnx"}  # a plan is built from the raw graph, with its inputs
        if config.platform in native:
            graph = models / name / "1" / native[config.platform]
            if graph.is_file():
                problems += _check_onnx_graph(name, config, graph)
            else:
                problems.append(f"{name}: {graph.relative_to(models)} is missing")
    return problems
