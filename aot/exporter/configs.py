"""The Triton model configs of a deployment folder, generated from one source (aot.serving.repository reads the rest).

    REPO/models/tokenizer/      python: TEXT (+ TEXT_PAIR), TASK -> token ids, TASK_VERSION, word_index, word_text
                                (tokenizer in 1/tokenizer)
    REPO/models/aot_lookup/     python: TASK_VERSION, token ids -> aot_rows, aot_index or aot_bias (the bias
                                interface; native GPU ensemble only)
    REPO/models/backbone/       the AoT graph: onnxruntime_onnx or tensorrt_plan (GPU);
                                --format torch: python + PyTorch, looking rows up itself (no aot_lookup)
    REPO/models/backbone_vanilla/ the same encoder without bias inputs (comparisons, plain models)
    REPO/models/head/           python: TASK_VERSION, pooled_hidden, token_hidden, word_index, word_text -> ANSWER,
                                LOGITS, LABEL (each request its own task's head by its kind)
    REPO/models/aot/, vanilla/  what clients call: the native GPU configs, the ensembles of the steps above; the CPU
                                configs and the torch engine's (CPU or GPU), one fused python step each (tokenizer,
                                lookup, encoder, head in one process: aot/model_repository/fused)

Each model folder has `config.pbtxt` (GPU, NGC image) and `configs/cpu.pbtxt` (local CPU server, selected with
--model-config-name=cpu). Both come from `model_configs()`, so they cannot drift apart.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format

from aot.serving import protocol
from aot.serving.repository import BackboneRecord, ServingOptions

TEMPLATES = Path(__file__).resolve().parent.parent / "model_repository"
# model -> template; `aot` and `vanilla` are ensembles in the native GPU configs (their model.py unused there) and the
# fused step in the CPU configs and in the torch engine's GPU configs (_ensemble)
PYTHON_MODELS = {"tokenizer": "tokenizer", "aot_lookup": "aot_lookup", "backbone": "backbone",
                 "backbone_vanilla": "backbone", "head": "head", "task_list": "task_list", "aot": "fused",
                 "vanilla": "fused"}
CPU_CONFIG = "configs/cpu.pbtxt"  # selected by tritonserver --model-config-name=cpu
FP16_FILE = "model.fp16.onnx"  # the fp16 twin of a graph, beside model.onnx, for ONNX Runtime on a GPU


# --- config generation: the one source of every config.pbtxt --------------------------------------------------

def _pb():
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def _tensor(kind, name: str, dims: list[int], ragged: bool = False, optional: bool = False):
    """A config input/output whose data type comes from the protocol's one definition."""
    pb = _pb()
    dtype = protocol.triton_type(name)
    t = kind(name=name, data_type=getattr(pb, "TYPE_STRING" if dtype == protocol.BYTES else f"TYPE_{dtype}"), dims=dims)
    if ragged:
        t.allow_ragged_batch = True
    if optional:
        t.optional = True
    return t


def _python_model(name: str, options: ServingOptions, params: dict[str, str], queue_delay_us: int = 0,
                  instances: int = 1):
    pb = _pb()
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=options.max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    set_cpu_instances(config, instances)
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def batch_when_free(config) -> None:
    """A step that takes the clients' optional inputs forms its next batch when one of its instances is free, not
    before. Triton (2.51, and its main branch) batches only requests of one input set when inputs are optional
    (scheduler_utils.cc, RequiredEqualInputs::HasEqualInputs), and clients send several (TEXT + TASK, with TEXT_PAIR,
    token ids); with prefetching, its default, the batcher readies a batch while every instance is busy, and a
    queued request of another input set behind it made BatcherThread loop without waiting until an instance took
    that batch (dynamic_batch_scheduler.cc, GetDynamicBatch: nothing pending, payload_saturated_ unset): a core of
    tritonserver spinning (docs/benchmarks.md, "The batcher's spin"). A queue policy that allows a request's timeout
    override turns prefetching off (PriorityQueue's support_prefetching_); a request without a timeout is queued as
    before."""
    config.dynamic_batching.default_queue_policy.allow_timeout_override = True


def set_cpu_instances(config, instances: int) -> None:
    """`instances` CPU instances of a python step. Several get a group each, with a host policy of their own: Triton
    tells instances apart by their group's fields but name and count, so that the supervisor can replace one alone
    (aot.serving.supervision.instance_groups; a host policy no --host-policy flag names means Triton's defaults)."""
    pb = _pb()
    del config.instance_group[:]
    if instances == 1:
        config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)
    for i in range(instances if instances > 1 else 0):
        group = f"{config.name}_{i}"
        config.instance_group.add(name=group, kind=pb.ModelInstanceGroup.KIND_CPU, count=1, host_policy=group)


def set_gpu_instances(config, instances: int) -> None:
    """`instances` GPU instances of a python step, a group each (one instance per GPU each), so that the supervisor
    can replace one alone, as set_cpu_instances."""
    pb = _pb()
    del config.instance_group[:]
    for i in range(instances):
        config.instance_group.add(name=f"{config.name}_{i}", kind=pb.ModelInstanceGroup.KIND_GPU, count=1)


def instance_count(config) -> int:
    """How many instances a config asks for (the sum of its groups' counts)."""
    return sum(g.count for g in config.instance_group)


def _in_process_lookup(target: str, options: ServingOptions) -> bool:
    """Whether the AoT backbone step looks rows up itself (CPU configs, and the torch engine everywhere: its pool is
    on the backbone's device) rather than receiving them from the aot_lookup step (native GPU backends)."""
    return target == "cpu" or options.engine == "torch"


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes a TensorRT backbone captures CUDA graphs for: 1, 2, 3, 4, then steps of 1.5x and 2x (6, 8, 12,
    16, 24, 32, 48, ...), and max_batch_size. A batch between two sizes replays the larger one's graph padded, so a
    step of at most 1.5x bounds that padding (Triton's own default list jumps from 16 to the max: at 32, a batch of
    17 would compute 32 sequences)."""
    sizes = {1, 2, 3, max_batch_size}
    step = 4
    while step < max_batch_size:
        sizes |= {step, step * 3 // 2}
        step *= 2
    return sorted(b for b in sizes if b <= max_batch_size)


def _graph_specs(config, inputs: dict[str, list[int]], options: ServingOptions, max_seq: int) -> None:
    """TensorRT CUDA graphs for every bucket the tokenizer pads to at every size of graph_batch_sizes, each taking
    the batch sizes above the previous one (graph_lower_bound: a batch of 5 replays the graph of 6, padded). Read in
    tensorrt_backend (InitializeGraphSpecs, FindClosestCudaGraph): graphs are captured at load for the specs alone,
    and a batch replays one only if the specs' shapes cover it; a backbone with dynamic batching and no specs
    captures batch 1 and max_batch_size at the profile's optimal sequence length only. The sizes are not made the
    dynamic batcher's preferred batch sizes: a preferred size is sent at once (Triton core, GetDynamicBatch), which
    would turn the queue delay off for every batch that reaches one; whether that trade pays is for a GPU to show.
    `inputs`: each input's dims after the batch, -1 standing for the bucket's length."""
    sizes = graph_batch_sizes(options.max_batch_size)
    for seq in (b for b in options.buckets if b <= max_seq):
        for lower, size in zip([1] + [s + 1 for s in sizes[:-1]], sizes, strict=True):
            spec = config.optimization.cuda.graph_spec.add(batch_size=size)
            spec.graph_lower_bound.batch_size = lower
            for name, dims in inputs.items():
                shape = [seq if n == -1 else n for n in dims]
                spec.input[name].dim.extend(shape)
                spec.graph_lower_bound.input[name].dim.extend(shape)
    config.optimization.cuda.graphs = True


def _backbone(name: str, aot: bool, target: str, record: BackboneRecord):
    """The backbone step: a python step (ONNX Runtime on CPU; the torch engine on CPU or CUDA), or the native
    backend on GPU (the bias in the repository's interface: ragged rows + batch input, or the dense bias)."""
    pb = _pb()
    options = record.serving
    token_names = protocol.token_inputs(record.uses_token_type_ids)
    python = _in_process_lookup(target, options)
    if python:
        config = _python_model(name, options, _engine_parameters(name, target, record),
                               options.backbone_queue_delay_us)
    else:
        platform = "tensorrt_plan" if options.engine == "tensorrt" else "onnxruntime_onnx"
        # ONNX Runtime on a GPU runs the fp16 twin of the graph when export found it within parity
        onnx_file = FP16_FILE if record.precision == "fp16" else "model.onnx"
        config = pb.ModelConfig(name=name, platform=platform, max_batch_size=options.max_batch_size,
                                default_model_filename="model.plan" if options.engine == "tensorrt" else onnx_file)
        config.dynamic_batching.max_queue_delay_microseconds = options.backbone_queue_delay_us
        config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU, count=1)
    # A python step takes ragged inputs (it pads the batch itself); a native backend takes bucketed token tensors.
    if python and aot:  # the lookup runs inside this step: no extra step, no rows between processes
        config.input.append(_tensor(pb.ModelInput, protocol.TASK_VERSION, [1]))
    for n in token_names:
        config.input.append(_tensor(pb.ModelInput, n, [-1], ragged=python))
    dense = aot and not python and options.bias_interface == "dense"
    if dense:
        config.input.append(_tensor(pb.ModelInput, protocol.AOT_BIAS, [-1, record.num_layers, record.hidden_size]))
    elif aot and not python:
        config.input.append(_tensor(pb.ModelInput, protocol.AOT_ROWS, [-1], ragged=True))
        config.input.append(_tensor(pb.ModelInput, protocol.AOT_INDEX, [-1]))
        config.batch_input.add(kind=pb.BatchInput.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO,
                               target_name=[protocol.AOT_ROW_OFFSETS], data_type=pb.TYPE_INT32,
                               source_input=[protocol.AOT_ROWS])
    # TensorRT replays CUDA graphs only for the shapes captured at load: the bucketed shapes of the vanilla and dense
    # graphs. The backend can key a graph on a ragged input's total length too, but a padded replay of the rows graph
    # would gather the padded slots' rows through stale aot_index values, possibly past the rows given: until a GPU
    # shows that is safe, the rows backbone runs without graphs.
    if options.engine == "tensorrt" and not python and (dense or not aot):
        _graph_specs(config, {i.name: list(i.dims) for i in config.input}, options,
                     record.tensorrt_profile["max_seq"])
    config.output.append(_tensor(pb.ModelOutput, protocol.POOLED_HIDDEN, [len(protocol.POOLINGS), record.hidden_size]))
    config.output.append(_tensor(pb.ModelOutput, protocol.TOKEN_HIDDEN, [-1, record.hidden_size]))
    return config


def _engine_parameters(backbone: str, target: str, record: BackboneRecord) -> dict[str, str]:
    """How a python step runs the encoder of model folder `backbone` (aot.serving.stages.Encoder): ONNX Runtime on its
    graph (on CPU, the int8 twin of an int8 repository, one request at a time: aot.exporter.quantize), or the torch
    engine on the target's device."""
    options = record.serving
    if options.engine == "torch":
        return {"engine": "torch", "device": "cpu" if target == "cpu" else "cuda", "threads": str(options.cpu_threads)}
    alone = target == "cpu" and record.cpu_per_request
    graph = record.cpu_graph(backbone) if target == "cpu" else f"{backbone}/1/model.onnx"
    return {"engine": "onnx", "onnx_file": graph,
            "threads": str(options.cpu_threads), **({"per_request": "true"} if alone else {})}


def _fused(name: str, backbone: str, record: BackboneRecord, target: str):
    """`aot` / `vanilla` as one python step doing what the native GPU ensemble's steps do (tokenizer, lookup, encoder,
    head; aot/model_repository/fused), with the client's inputs and the ensemble's outputs: the CPU configs, and the
    torch engine's GPU configs (its pool and CUDA graphs on the GPU; `gpu_instances` of it, so that one prepares a
    batch while another's runs, batching with the backbone's queue delay). One hop through the server instead of
    three: docs/benchmarks.md, "The serving tax"."""
    options = record.serving
    params = {"aot": "true" if backbone == "backbone" else "false", **_engine_parameters(backbone, target, record)}
    if target == "cpu":
        config = _python_model(name, options, params, options.cpu_queue_delay_us, instances=options.cpu_instances)
    else:
        config = _python_model(name, options, params, options.backbone_queue_delay_us)
        set_gpu_instances(config, options.gpu_instances)
    config.input.extend(_request_inputs(record, ragged=True))
    batch_when_free(config)
    _answer_outputs(config)
    return config


def _answer_outputs(config) -> None:
    """What the client gets back from `aot` / `vanilla` (protocol v6 on)."""
    pb = _pb()
    config.output.append(_tensor(pb.ModelOutput, protocol.ANSWER, [1]))  # the kind's answer, JSON (protocol v6)
    config.output.append(_tensor(pb.ModelOutput, protocol.LOGITS, [-1]))
    config.output.append(_tensor(pb.ModelOutput, protocol.LOGITS_WIDTH, [1]))  # each item's own (protocol v8)
    config.output.append(_tensor(pb.ModelOutput, protocol.LABEL, [1]))
    config.output.append(_tensor(pb.ModelOutput, protocol.TASK_VERSION, [1]))  # which version answered (protocol v5)


def _ensemble(name: str, backbone: str, record: BackboneRecord, target: str):
    """What clients call: one fused step (the CPU configs, the torch engine), or the native GPU ensemble of the
    separate steps (a native backend's engine is not Python: tokenizer, lookup and head around it)."""
    if target == "cpu" or record.serving.engine == "torch":
        return _fused(name, backbone, record, target)
    pb = _pb()
    options = record.serving
    config = pb.ModelConfig(name=name, platform="ensemble", max_batch_size=options.max_batch_size)
    config.input.extend(_request_inputs(record, ragged=False))
    _answer_outputs(config)
    tokens = protocol.token_inputs(record.uses_token_type_ids)
    version = protocol.TASK_VERSION
    steps = config.ensemble_scheduling.step
    tok = steps.add(model_name="tokenizer", model_version=-1)
    tok.input_map.update({t.name: t.name for t in _request_inputs(record, ragged=False)})
    words = {protocol.WORD_INDEX: f"_{protocol.WORD_INDEX}", protocol.WORD_TEXT: f"_{protocol.WORD_TEXT}"}
    tok.output_map.update({n: f"_{n}" for n in tokens} | {protocol.TASK_VERSION: version} | words)
    bb_inputs = {n: f"_{n}" for n in tokens}
    if backbone == "backbone" and _in_process_lookup(target, options):
        bb_inputs[protocol.TASK_VERSION] = version  # the backbone step looks the rows up itself
    elif backbone == "backbone":
        look = steps.add(model_name="aot_lookup", model_version=-1)
        look.input_map.update({protocol.TASK_VERSION: version, **{n: f"_{n}" for n in tokens}})
        bias = _lookup_outputs(options)
        look.output_map.update({n: f"_{n}" for n in bias})
        bb_inputs.update({n: f"_{n}" for n in bias})
    bb = steps.add(model_name=backbone, model_version=-1)
    bb.input_map.update(bb_inputs)
    states = {n: f"_{n}" for n in (protocol.POOLED_HIDDEN, protocol.TOKEN_HIDDEN)}
    bb.output_map.update(states)
    head = steps.add(model_name="head", model_version=-1)
    head.input_map.update({protocol.TASK_VERSION: version} | states | words)
    head.output_map.update({n: n for n in protocol.HEAD_OUTPUTS})
    return config


def _request_inputs(record: BackboneRecord, ragged: bool) -> list:
    """What a client sends the ensemble (and the ensemble the tokenizer step): TASK and TEXT (+ TEXT_PAIR), or TASK
    and the token ids it tokenized itself (`ragged`: in the tokenizer step, sequences of any length batch together).
    All optional: the first stage (the tokenizer step, or the fused step) refuses a request that lacks TASK,
    or both TEXT and ids, with a 400 naming it
    (Triton checks only the count of an ensemble's required inputs, and a required one missing would stall the
    ensemble: "unexpected deadlock")."""
    pb = _pb()
    return ([_tensor(pb.ModelInput, n, [1], optional=True) for n in (protocol.TEXT, protocol.TEXT_PAIR, protocol.TASK)]
            + [_tensor(pb.ModelInput, n, [-1], ragged=ragged, optional=True)
               for n in protocol.token_inputs(record.uses_token_type_ids)])


def _lookup_outputs(options: ServingOptions) -> list[str]:
    """What the aot_lookup step sends the native backbone: its graph's bias inputs but the batch input Triton adds."""
    return [n for n in protocol.bias_inputs(options.bias_interface) if n != protocol.AOT_ROW_OFFSETS]


def model_configs(record: BackboneRecord, target: str) -> dict:
    """Every model's config for `target` "cpu" (local server) or "gpu" (NGC image), served as `record.serving`
    says."""
    pb = _pb()
    options = record.serving
    tokens = protocol.token_inputs(record.uses_token_type_ids)
    # Bucketed token tensors for a native backend; a python backbone step pads each batch itself.
    buckets = "" if _in_process_lookup(target, options) else ",".join(str(b) for b in options.buckets)
    # Tokenizer and head run one thread per instance: ServingOptions.instances of each (the backbone's engine
    # threads itself; the lookup stays one instance: each would hold its own task pool in device memory)
    instances = options.instances(target)
    # a native backbone taking ragged rows (one row offset per request) takes one text per request
    one = not _in_process_lookup(target, options) and options.bias_interface == "rows"
    tok = _python_model("tokenizer", options, {"buckets": buckets, **({"one_text_per_request": "true"} if one else {})},
                        instances=instances)
    tok.input.extend(_request_inputs(record, ragged=True))
    batch_when_free(tok)
    tok.output.extend([_tensor(pb.ModelOutput, n, [-1]) for n in tokens]
                      + [_tensor(pb.ModelOutput, protocol.TASK_VERSION, [1]),
                         _tensor(pb.ModelOutput, protocol.WORD_INDEX, [-1]),
                         _tensor(pb.ModelOutput, protocol.WORD_TEXT, [1])])

    # The native GPU ensemble's lookup keeps its task pool in device memory (torch) and hands the rows to the
    # backbone as GPU tensors (DLPack); the CPU config keeps it in host memory.
    gpu = target != "cpu"
    look = _python_model("aot_lookup", options, {"device": "cuda" if gpu else "cpu",
                                                  "pool_storage": "torch" if gpu else "host"})
    if gpu:
        look.instance_group[0].kind = pb.ModelInstanceGroup.KIND_GPU
    look.input.extend([_tensor(pb.ModelInput, protocol.TASK_VERSION, [1])]
                      + [_tensor(pb.ModelInput, n, [-1], ragged=True) for n in tokens])
    dims = {protocol.AOT_ROWS: [-1], protocol.AOT_INDEX: [-1],
            protocol.AOT_BIAS: [-1, record.num_layers, record.hidden_size]}
    look.output.extend([_tensor(pb.ModelOutput, n, dims[n]) for n in _lookup_outputs(options)])

    head = _python_model("head", options, {}, instances=instances)
    head.input.extend([_tensor(pb.ModelInput, protocol.TASK_VERSION, [1]),
                       _tensor(pb.ModelInput, protocol.POOLED_HIDDEN, [len(protocol.POOLINGS), record.hidden_size]),
                       # what a token task's head reads (the ensemble always sends them; a pooled kind needs none)
                       _tensor(pb.ModelInput, protocol.TOKEN_HIDDEN, [-1, record.hidden_size], optional=True),
                       _tensor(pb.ModelInput, protocol.WORD_INDEX, [-1], optional=True),
                       _tensor(pb.ModelInput, protocol.WORD_TEXT, [1], optional=True)])
    head.output.extend([_tensor(pb.ModelOutput, n, [-1] if n == protocol.LOGITS else [1])
                        for n in protocol.HEAD_OUTPUTS])
    tasks = _python_model("task_list", options, {})
    tasks.max_batch_size = 0  # no inputs: a model with batching needs one to read the batch size from
    tasks.ClearField("dynamic_batching")
    tasks.output.append(_tensor(pb.ModelOutput, protocol.TASKS, [1]))
    configs = {"tokenizer": tok, "aot_lookup": look, "head": head, "task_list": tasks,
               "backbone": _backbone("backbone", True, target, record),
               "backbone_vanilla": _backbone("backbone_vanilla", False, target, record),
               "aot": _ensemble("aot", "backbone", record, target),
               "vanilla": _ensemble("vanilla", "backbone_vanilla", record, target)}
    if options.engine == "torch":  # its backbone step looks rows up on its own device: no lookup step anywhere
        del configs["aot_lookup"]
    return configs


def to_pbtxt(config) -> str:
    return text_format.MessageToString(config)


def parse_pbtxt(text: str):
    return text_format.Parse(text, _pb().ModelConfig())


def write_configs(models: Path, record: BackboneRecord) -> list[str]:
    """config.pbtxt (GPU) and configs/cpu.pbtxt (CPU) for every model of the repository `record` describes, under
    REPO/models; returns the models."""
    gpu, cpu = model_configs(record, "gpu"), model_configs(record, "cpu")
    for name in gpu:
        folder = models / name
        (folder / "configs").mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(to_pbtxt(gpu[name]))
        (folder / CPU_CONFIG).write_text(to_pbtxt(cpu[name]))
        (folder / "1").mkdir(exist_ok=True)
    return list(gpu)
