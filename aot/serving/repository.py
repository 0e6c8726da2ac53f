"""The deployment folder's record, as the served steps and the tools read it: format `aot-repository` v3.

    REPO/aot_repository.json    backbone identity and limits, protocol version, serving options, where things are
    REPO/tasks/                 the task store (aot.serving.store.reader); its location is the record's `store`
    REPO/models/                the Triton model repository (--model-repository=REPO/models)

The record is one frozen dataclass, BackboneRecord: `aot export backbone` builds it once (aot.exporter.backbone_export)
and writes it with `to_json`; a served step finds it from its model folder (REPO/models/<model>), reads it with
`from_json` (read_repository) and every path from it (RepositoryInfo).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from aot import settings
from aot.serving import protocol
from aot.serving.formats import FormatError, check_keys, read_json
from aot.settings import SettingError

REPO_FORMAT = "aot-repository"
REPO_VERSION = 4  # 3: the CPU configs serve `aot` / `vanilla` from one fused step; 4: the task store v2 (a log)
RECORD = "aot_repository.json"
MODELS_DIR = "models"
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)
ENGINES = ("onnx", "tensorrt", "torch")
# Tokenizer and head instances in the GPU configs: each runs its requests on one thread, so one instance caps the
# server's request rate at what that thread can do; 6 lift each step's ceiling above what the server's own CPU per
# request allows on a large host (`aot bench tax`; the figures: docs/benchmarks.md, "The serving tax").
GPU_STEP_INSTANCES = 6
# What a server loads where `aot` is one fused step (tokenizer, lookup, encoder, head): the CPU configs, and the torch
# engine's GPU configs; the native GPU ensembles' separate steps are not needed there (models_to_load).
FUSED_MODELS = ("aot", "task_list")
# The plain encoder, for comparisons (benchmarks): loaded only when asked (`aot serve --vanilla`; in a container,
# AOT_LOAD_VANILLA=1), each one more engine and, on CPU, more step processes.
VANILLA_MODELS = ("vanilla", "backbone_vanilla")


class RepositoryError(ValueError):
    pass


@dataclass
class ServingOptions:
    """Knobs of the served steps and their generated configs (recorded in the repository, docs/formats.md). Each
    field's metadata is the one source of its `aot export backbone` flag: `flag`, `help`, and `minimum` (integers)
    or `choices`."""

    max_batch_size: int = field(default=32, metadata={
        "flag": "--max-batch-size", "minimum": 1,
        "help": "Triton max_batch_size of every step: the most texts one batch runs, and one request may carry"})
    backbone_queue_delay_us: int = field(default=500, metadata={
        "flag": "--queue-delay-us", "minimum": 0,
        "help": "dynamic-batching queue delay of the GPU configs' batched step: the native backbone, or the torch "
                "engine's one step (µs; the CPU configs: --cpu-queue-delay-us)"})
    cpu_threads: int = field(default=0, metadata={
        "flag": "--cpu-threads", "minimum": 0,
        "help": "engine threads of each CPU step that runs the encoder (0: the host's cores divided among its "
                "instances, --cpu-instances)"})
    buckets: tuple[int, ...] = field(default=DEFAULT_BUCKETS, metadata={
        "flag": "--buckets", "help": "GPU: sequence lengths token tensors are padded to, so that requests batch "
                                     "together (lengths past what the encoder accepts are replaced by its limit)"})
    engine: str = field(default="onnx", metadata={
        "flag": "--format", "choices": ENGINES,
        "help": "engine of the backbone: onnx (the NGC image's onnxruntime backend; locally ONNX Runtime in a python "
                "step on CPU), tensorrt (a TensorRT plan, built here if tensorrt is importable, else by the "
                "engine-builder service of docker-compose.yml; locally as onnx), or torch (PyTorch in a python step "
                "on CPU or CUDA, fp16 + CUDA graphs on a GPU, the task pool on the same device: `aot serve --device "
                "cuda` serves it with the local tritonserver)"})
    bias_interface: str = field(default="rows", metadata={
        "flag": "--bias-interface", "choices": protocol.BIAS_INTERFACES,
        "help": "native GPU backends (onnx, tensorrt): how the lookup step hands each request's bias to the "
                "backbone: rows (the rows of its distinct tokens + each token's index: fewest bytes, but a ragged "
                "shape that changes with every batch) or dense (an fp16 bias per token of the bucketed sequence: "
                "more bytes, fixed shapes per bucket, so TensorRT replays CUDA graphs captured for them). The CPU "
                "configs' fused step looks rows up itself and runs the graph of either; the torch engine has no "
                "lookup step and takes rows only. docs/benchmarks.md, 'GPU serving: the torch engine' compares them"})
    pool_bytes: int = field(default=1 << 30, metadata={
        "flag": "--pool-bytes", "minimum": 0,
        "help": "memory of the task pool, the rows of P kept by the lookup (bytes; 0: no pool, fused tables are read "
                "through their memory maps and factored rows computed per request). Every task is fully resident "
                "while all fit; beyond that the pool caches the most recently used rows. On CPU each instance of the "
                "fused step holds an equal share, and with several instances fused tables are read through their "
                "memory maps (one copy in the page cache) and the pool caches factored rows. `aot serve "
                "--pool-bytes` overrides it"})
    step_instances: int = field(default=0, metadata={
        "flag": "--step-instances", "minimum": 0,
        "help": "instances of the GPU ensembles' tokenizer and head steps: each runs its requests on one "
                "thread, so one instance caps a server at 1e6 / (its microseconds per request) requests/s (`aot bench "
                "tax`). 0: 6 in the GPU configs (1 in their CPU configs, which the local server loads only when asked; "
                "the CPU configs serve clients from one fused step, --cpu-instances)"})
    gpu_instances: int = field(default=4, metadata={
        "flag": "--gpu-instances", "minimum": 1,
        "help": "instances of the torch engine's GPU step (`aot`, `vanilla`: tokenizer, lookup, encoder and head in "
                "one process on the GPU), each with its own CUDA graphs, device heads and an equal share of the task "
                "pool, and the host's cores shared among their tokenizers: while one's batch runs on the GPU, the "
                "others prepare theirs on the CPU (one python process per instance bounds what each prepares). 4 "
                "fits a host of 16 cores or more; give fewer on a smaller one"})
    cpu_instances: int = field(default=2, metadata={
        "flag": "--cpu-instances", "minimum": 1,
        "help": "instances of the CPU configs' one step (`aot`, `vanilla`: tokenizer, lookup, encoder and head in one "
                "process), each with its own engine session (--cpu-threads threads; by default the host's cores "
                "divided among them), tokenizer and task pool (the pool budget is split between them; fused tables "
                "are then read through their memory maps, shared by the page cache): one runs the encoder while "
                "another's requests cross the server. 2 served 1.2-1.35x the requests/s of 1 under load on 2 cores; "
                "1 has the lowest latency for one request at a time on a small host (all its cores on one request; "
                "`aot bench tax`)"})
    cpu_queue_delay_us: int = field(default=0, metadata={
        "flag": "--cpu-queue-delay-us", "minimum": 0,
        "help": "dynamic-batching queue delay of the CPU configs' fused step (µs): 0 sends whatever is queued as soon "
                "as an instance is free (requests queue while it is busy anyway, so a delay only adds latency: 0.5 ms "
                "at concurrency 1 for 500 µs, with no throughput gained, `aot bench tax`)"})
    task_cache_bytes: int = field(default=512 << 20, metadata={
        "flag": "--task-cache-bytes", "minimum": 0,
        "help": "memory of the task versions a host keeps loaded (heads, factors, a fused table's block list; "
                "bytes), shared by its step processes: a version is loaded on its first request, into a copy every "
                "process serves, and past this the host's W-TinyLFU policy drops versions (a process that cannot "
                "share keeps its own under this bound); the task pool, --pool-bytes, holds rows apart from it; "
                "`aot serve` states both"})
    audit_bytes_per_second: int = field(default=32 << 20, metadata={
        "flag": "--audit-bytes-per-second", "minimum": 0,
        "help": "how fast the task_list step checks every task version's files against their published digests in "
                "the background (bytes hashed per second; 0: no audit); `aot tasks` reports its progress"})
    max_text_bytes: int = field(default=65536, metadata={
        "flag": "--max-text-bytes", "minimum": 1,
        "help": "longest TEXT (and TEXT_PAIR) a request may send, in UTF-8 bytes; longer ones are refused at once "
                "(texts are truncated to at most 512 tokens anyway)"})
    max_request_bytes: int = field(default=1 << 20, metadata={
        "flag": "--max-request-bytes", "minimum": 1,
        "help": "largest request body the fleet's load balancer reads whole (and buffers, to retry it on another "
                "replica): a request of many texts together (at least one text of --max-text-bytes with its pair "
                "fits whatever this says); a larger one is refused with 413, and aot.Client sends its texts again "
                "one a request"})

    def __post_init__(self):
        self.buckets = tuple(sorted(int(b) for b in self.buckets))
        for f in fields(self):
            value = getattr(self, f.name)
            if "choices" in f.metadata:
                if value not in f.metadata["choices"]:
                    what = f.name.replace("_", " ")
                    raise RepositoryError(f"{what} {value!r}: expected one of {', '.join(f.metadata['choices'])}")
            elif f.name == "buckets":
                if not value or min(value) < 1:
                    raise RepositoryError(f"buckets {list(value)}: expected positive lengths")
            elif not isinstance(value, int) or isinstance(value, bool) or value < f.metadata["minimum"]:
                kind = "non-negative" if f.metadata["minimum"] == 0 else "positive"
                raise RepositoryError(f"serving option {f.name} = {value!r}: expected a {kind} integer")

    def instances(self, target: str) -> int:
        """Instances of each light python step in the configs of `target` ("cpu" or "gpu")."""
        return self.step_instances or (1 if target == "cpu" else GPU_STEP_INSTANCES)

    def to_json(self) -> dict:
        data = asdict(self)
        data["buckets"] = list(self.buckets)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ServingOptions":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


_REQUIRED = {"protocol_version": int, "backbone": dict, "uses_token_type_ids": bool, "num_layers": int,
             "hidden_size": int, "vocab_size": int, "type_vocab_size": int, "max_positions": int, "serving": dict,
             "store": str, "tokenizer": str}
# Keys a record may lack (written before they were recorded): checked when present
_OPTIONAL = {"encoder": (str, type(None)), "precision": (str, type(None)), "tensorrt_profile": (dict, type(None)),
             "parity_max_abs_diff": dict, "task_store_url": (str, type(None)), "cpu_precision": str,
             "quantization": (dict, type(None))}
CPU_PRECISIONS = ("fp32", "int8")
INT8_GRAPH = "model.int8.onnx"  # beside model.onnx (aot.exporter.quantize writes it)
_PATHS = ("store", "tokenizer", "encoder")  # relative to the repository


@dataclass(frozen=True, kw_only=True)
class BackboneRecord:
    """What `aot export backbone` records of a repository (REPO/aot_repository.json, docs/formats.md): built once by
    the export, read by every served step and tool. Fields in the file's order; paths relative to the repository."""

    protocol_version: int = protocol.PROTOCOL_VERSION
    backbone: dict  # identity: model, model_type, fingerprint, num_layers, hidden_size, vocab_size
    uses_token_type_ids: bool
    num_layers: int
    hidden_size: int
    vocab_size: int
    type_vocab_size: int
    max_positions: int  # the longest token sequence served: the encoder's limit, or the longest bucket
    store: str
    tokenizer: str
    encoder: str | None = None  # the torch engine's weights (--format torch)
    serving: ServingOptions
    precision: str | None = None  # the GPU backbone's: fp32 or fp16 (None: the torch engine)
    tensorrt_profile: dict | None = None  # aot.exporter.tensorrt.Profile's fields (--format tensorrt)
    parity_max_abs_diff: dict = field(default_factory=dict)  # graph -> largest difference from PyTorch at export
    cpu_precision: str = "fp32"  # what the CPU configs run: fp32 (model.onnx) or int8 (model.int8.onnx)
    quantization: dict | None = None  # int8: how the graphs were quantized (aot.training.quantized.QUANTIZATION)
    # the tasks in object storage (s3://BUCKET/PREFIX; None: in `store`, which keeps the embeddings and rows graphs)
    task_store_url: str | None = None

    @property
    def model(self) -> str:
        return self.backbone["model"]

    def cpu_graph(self, backbone: str = "backbone") -> str:
        """The graph the CPU configs run for model folder `backbone` (or `backbone_vanilla`), under the models folder:
        the int8 twin in an int8 repository."""
        return f"{backbone}/1/{INT8_GRAPH if self.cpu_precision == 'int8' else 'model.onnx'}"

    @property
    def cpu_per_request(self) -> bool:
        """The CPU graph runs each request alone: an int8 graph's activation scale is taken over its whole input, so
        batched, one request's answer would depend on its neighbours (aot.exporter.quantize)."""
        return self.cpu_precision == "int8"

    @property
    def fingerprint(self) -> str:
        return self.backbone["fingerprint"]

    def to_json(self) -> dict:
        data = {"format": REPO_FORMAT, "format_version": REPO_VERSION}
        data.update((f.name, getattr(self, f.name)) for f in fields(self))
        data["serving"] = self.serving.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict, where: str = RECORD, version: int = REPO_VERSION,
                  any_protocol: bool = False) -> "BackboneRecord":
        """The record in `data`, an `aot-repository` v`version` file (`where` names it in errors). A file of another
        format or version, a missing key or a value of the wrong type: FormatError; another protocol (unless
        `any_protocol`: a re-export reading what it keeps), a path outside the repository or serving options out of
        range: RepositoryError."""
        if not isinstance(data, dict):
            raise FormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != REPO_FORMAT or data.get("format_version") != version:
            raise FormatError(f"{where}: not an {REPO_FORMAT} v{version} file (format {data.get('format')!r}, "
                              f"version {data.get('format_version')!r})")
        check_keys(data, _REQUIRED, where)
        check_keys(data, {k: kind for k, kind in _OPTIONAL.items() if k in data}, where)
        check_keys(data["backbone"], {"model": str, "fingerprint": str}, f"{where}: backbone")
        if data["protocol_version"] != protocol.PROTOCOL_VERSION and not any_protocol:
            raise RepositoryError(f"{where}: protocol version {data['protocol_version']} is not "
                                  f"{protocol.PROTOCOL_VERSION} (exported by an older release); re-export the "
                                  f"backbone with this version: `aot export backbone --model MODEL --repo "
                                  f"{Path(where).parent} --overwrite` keeps its tasks")
        url = data.get("task_store_url")
        if url is not None and not url.startswith("s3://"):
            raise RepositoryError(f"{where}: 'task_store_url' must be s3://BUCKET/PREFIX, got {url!r}")
        for key in _PATHS:
            if data.get(key) is not None and (Path(data[key]).is_absolute() or ".." in Path(data[key]).parts):
                raise RepositoryError(f"{where}: {key!r} must be a path inside the repository, got {data[key]!r}")
        if data.get("cpu_precision", "fp32") not in CPU_PRECISIONS:
            raise RepositoryError(f"{where}: cpu_precision {data['cpu_precision']!r}: expected one of "
                                  f"{', '.join(CPU_PRECISIONS)}")
        try:
            serving = ServingOptions.from_json(data["serving"])
        except (TypeError, ValueError) as exc:  # RepositoryError included
            raise RepositoryError(f"{where}: {exc}") from None
        return cls(**{**{f.name: data[f.name] for f in fields(cls) if f.name in data}, "serving": serving})


@dataclass
class RepositoryInfo:
    """A repository: where it is, and its record."""

    path: Path
    record: BackboneRecord

    # The record's fields that served steps and tools read, by their own names
    @property
    def model(self) -> str:
        return self.record.model

    @property
    def fingerprint(self) -> str:
        return self.record.fingerprint

    @property
    def uses_token_type_ids(self) -> bool:
        return self.record.uses_token_type_ids

    @property
    def num_layers(self) -> int:
        return self.record.num_layers

    @property
    def hidden_size(self) -> int:
        return self.record.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.record.vocab_size

    @property
    def type_vocab_size(self) -> int:
        return self.record.type_vocab_size

    @property
    def max_positions(self) -> int:
        """The longest token sequence the backbone accepts (a task's max length may not exceed it)."""
        return self.record.max_positions

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / self.record.tokenizer

    @property
    def models(self) -> Path:
        return self.path / MODELS_DIR

    @property
    def backbone_onnx(self) -> Path:
        return self.models / "backbone" / "1" / "model.onnx"

    def cpu_graph(self, backbone: str = "backbone") -> Path:
        """The graph the CPU configs run for `backbone` (or `backbone_vanilla`): the int8 twin in an int8 repository."""
        return self.models / self.record.cpu_graph(backbone)

    @property
    def encoder_dir(self) -> Path:
        """The encoder's config and weights, for the torch engine (`--format torch`)."""
        if not self.record.encoder:
            raise RepositoryError(f"{self.path}: no encoder folder (exported with engine "
                                  f"{self.record.serving.engine!r}, not torch)")
        return self.path / self.record.encoder

    @property
    def store_root(self) -> Path:
        return self.path / self.record.store

    @property
    def store_url(self) -> str | None:
        """Where the tasks live when not in store_root: an S3 URL (aot export backbone --store)."""
        return self.record.task_store_url

    @property
    def options(self) -> ServingOptions:
        """The recorded serving options (a copy of the record's); `AOT_POOL_BYTES` in the environment (set by `aot
        serve --pool-bytes`) overrides the pool budget without a re-export."""
        options = replace(self.record.serving)
        try:
            override = settings.POOL_BYTES.read()
        except SettingError as exc:
            raise RepositoryError(str(exc)) from None
        if override is not None:
            options.pool_bytes = override
        return options


def largest_batch_bytes(info: RepositoryInfo) -> int:
    """Bytes of the tensors that pass between the steps of the repository's largest batch (max batch size x the
    longest bucket): token tensors and each token's word (word_index), the lookup's bias (native GPU backends only:
    the torch engine looks up in its own process; rows of every token distinct + index, or the dense bias), the
    backbone's states (pooled, and every token's: a native backend sends them for every request) and the logits."""
    options = info.options
    batch, seq = options.max_batch_size, min(max(options.buckets), info.max_positions)
    elements = batch * seq
    size = len(protocol.token_inputs(info.uses_token_type_ids)) * elements * protocol.TOKEN_DTYPE.itemsize
    size += elements * (protocol.INDEX_DTYPE.itemsize + info.hidden_size * protocol.HIDDEN_DTYPE.itemsize)
    if options.engine != "torch":
        size += elements * info.num_layers * info.hidden_size * protocol.ROWS_DTYPE.itemsize
        if options.bias_interface == "rows":
            size += elements * protocol.INDEX_DTYPE.itemsize
    # the pooled states (one row per pooling), and logits at most as wide as one row
    size += batch * info.hidden_size * protocol.HIDDEN_DTYPE.itemsize * (len(protocol.POOLINGS) + 1)
    return size


def memory_pool_bytes(info: RepositoryInfo) -> dict[str, int]:
    """tritonserver's CUDA and pinned memory pools for this repository: twice its largest batch's tensors between
    steps (one batch in flight while the next is formed), rounded up to MiB and never below Triton's defaults
    (64 MiB CUDA, 256 MiB pinned). Smaller pools make those tensors fall back to (unpinned) host memory without a
    word (server#1765, #3511)."""
    mib = 1 << 20
    need = -(-2 * largest_batch_bytes(info) // mib) * mib
    return {"cuda": max(need, 64 * mib), "pinned": max(need, 256 * mib)}


# The oldest record whose task store a backbone re-export keeps (the store's format has not changed since)
OLDEST_KEPT_VERSION = 2


def models_to_load(info: RepositoryInfo, target: str, vanilla: bool = False) -> list[str]:
    """The models a server of `target` ("cpu" or "gpu") loads: where `aot` is one fused step (the CPU configs, the
    torch engine's GPU configs) that step and the task list; the native GPU ensembles with their steps. The plain
    encoder (VANILLA_MODELS: comparisons only, one more engine) only with `vanilla`."""
    if target == "cpu" or info.options.engine == "torch":
        return sorted(FUSED_MODELS + (VANILLA_MODELS[:1] if vanilla else ()))
    skip = () if vanilla else VANILLA_MODELS
    return sorted(p.name for p in info.models.iterdir() if (p / "config.pbtxt").is_file() and p.name not in skip)


def read_repository(path: str | Path, older: bool = False) -> RepositoryInfo:
    """The record of the repository at `path`, of this version; with `older`, of any version since
    OLDEST_KEPT_VERSION (what `aot export backbone --overwrite` reads to keep the tasks of the one it replaces)."""
    path = Path(path)
    record_path = path / RECORD
    if not record_path.is_file():
        raise RepositoryError(f"{path}: not an AoT model repository (no {RECORD}); run `aot export backbone` first")
    versions = range(OLDEST_KEPT_VERSION, REPO_VERSION + 1) if older else (REPO_VERSION,)
    found = None
    try:
        data = read_json(record_path)
        found = data.get("format_version")
        record = BackboneRecord.from_json(data, str(record_path), found if found in versions else REPO_VERSION,
                                          any_protocol=older)
    except FormatError as exc:
        keeps = isinstance(found, int) and OLDEST_KEPT_VERSION <= found < REPO_VERSION
        how = (f"`aot export backbone --repo {path} --overwrite`: it keeps the tasks" if keeps else
               "`aot export backbone` into a new folder, then `aot export task` each task")
        raise RepositoryError(f"{exc}; re-export the backbone with this version ({how})") from None
    if not (path / MODELS_DIR).is_dir():
        raise RepositoryError(f"{path}: the repository has no {MODELS_DIR}/ folder; re-export the backbone")
    return RepositoryInfo(path, record)


def repository_of_model(model_dir: str | Path) -> RepositoryInfo:
    """The repository a served model folder (REPO/models/<model>) belongs to."""
    return read_repository(Path(model_dir).resolve().parents[1])
