"""`aot export backbone`: the shared encoder, once per backbone, into a new model repository."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from aot.exporter.compose_env import ADMIN_KEY_FILE, write_admin_key, write_compose_env
from aot.exporter.config_checks import check_configs
from aot.exporter.configs import CPU_CONFIG, FP16_FILE, PYTHON_MODELS, TEMPLATES, write_configs
from aot.exporter.onnx_export import FP16_TOLERANCE, example_inputs, export_backbone_graph, export_fp16_graph
from aot.exporter.quantize import check_int8, int8_difference, quantize_graph
from aot.exporter.rows_export import write_rows_graphs
from aot.exporter.tensorrt import Profile, build_plan, build_script, write_parity_data
from aot.exporter.torch_export import export_torch_encoder
from aot.serving import protocol
from aot.serving.repository import (
    CPU_PRECISIONS,
    INT8_GRAPH,
    MODELS_DIR,
    RECORD,
    BackboneRecord,
    RepositoryError,
    RepositoryInfo,
    ServingOptions,
    read_repository,
)
from aot.serving.store.atomic import atomic_directory, write_json
from aot.serving.store.digests import file_digest
from aot.serving.store.layout import LEGACY_STAGING_PREFIX, LOCK, ROWS_DIR, STAGING
from aot.serving.store.s3 import is_s3_url, parse_s3_url
from aot.serving.store.writer import TaskStore
from aot.training.artifact import backbone_identity
from aot.training.backbone import Backbone, load_backbone
from aot.training.quantized import QUANTIZATION

STORE_DIR = "tasks"
ENCODER_DIR = "encoder"  # the torch engine's weights (--format torch)
TOKENIZER_DIR = f"{MODELS_DIR}/tokenizer/1/tokenizer"


@dataclass
class BackboneExportReport:
    repo: str
    max_abs_diff: dict[str, float]
    fused_ops: dict[str, dict[str, int]]
    sizes: dict[str, int]
    seconds: float
    notes: list[str] = field(default_factory=list)


def _copy_python_models(models: Path, names) -> None:
    for model, template in PYTHON_MODELS.items():
        if model not in names:
            continue
        (models / model / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy2(TEMPLATES / template / "1" / "model.py", models / model / "1" / "model.py")


GRAPHS = (("backbone", True), ("backbone_vanilla", False))  # model folder, AoT inputs


def _write_fp16_twins(backbone, models: Path, report: BackboneExportReport, explicit: bool,
                      options: ServingOptions) -> str:
    """fp16 twins of both graphs for ONNX Runtime on the GPU, each checked against PyTorch. Returns the GPU precision:
    "fp16", or "fp32" (no twin kept) when one misses parity and fp16 was not asked for explicitly (then: an error)."""
    for name, aot in GRAPHS:
        fp16, diff = export_fp16_graph(backbone, models / name / "1" / "model.onnx", aot,
                                       interface=options.bias_interface)
        report.max_abs_diff[f"{name}-fp16"] = diff
        if fp16 is None:
            problem = f"{name}: the fp16 graph differs from PyTorch by {diff:.3g} (> {FP16_TOLERANCE:g})"
            if explicit:
                raise RepositoryError(f"{problem}; nothing was written: export with --precision fp32")
            report.notes.append(f"{problem}; the GPU configs run fp32")
            for twin in models.glob(f"*/1/{FP16_FILE}"):
                twin.unlink()
            return "fp32"
    return "fp16"


@dataclass(frozen=True)
class ExportPlan:
    """What validation settled before anything is written."""

    repo: Path
    backbone: Backbone
    options: ServingOptions  # buckets past the encoder's limit replaced by it
    precision: str | None  # of the GPU backbone: fp32, fp16, or None (the torch engine)
    explicit: bool  # the precision was asked for: an fp16 graph out of parity is then an error, not a note
    profile: Profile  # TensorRT's, its sequences within the buckets
    longest: int  # the longest sequence the repository serves
    keep_tasks: RepositoryInfo | None  # the repository replaced by --overwrite, whose task store is kept
    store_url: str | None  # the tasks in object storage (s3://BUCKET/PREFIX), or None: in the repository
    cpu_precision: str = "fp32"  # what the CPU configs run: fp32, or int8 twins of both graphs (aot.exporter.quantize)


def export_backbone(model: str, repo: str | Path, options: ServingOptions | None = None, precision: str | None = None,
                    profile: Profile | None = None, overwrite: bool = False,
                    store: str | None = None, cpu_precision: str = "fp32") -> BackboneExportReport:
    """`precision` of the GPU backbone: fp32 or fp16. Default: fp16 for ONNX Runtime where the fp16 graph keeps
    parity (else fp32, with a note), fp32 for TensorRT (its fp16 plan is checked on the GPU by build_engines.sh);
    the torch engine runs fp16 on CUDA anyway. `cpu_precision`: what the CPU configs run, fp32, or int8 (both
    graphs quantized: aot.exporter.quantize; tasks are then checked for accuracy as they are published). `store`:
    s3://BUCKET/PREFIX to keep the tasks in object storage (aot.serving.store.s3; credentials and endpoint from the AWS
    variables); the backbone, tokenizer, embeddings and rows graphs stay in the repository. A re-export keeps the
    replaced repository's store.

    Three steps: validate (every refusal that needs no graph), export the graphs, write the repository; the last two
    into a temporary folder that replaces `repo` only when both succeed."""
    start = time.perf_counter()
    plan = _validate(model, Path(repo), options or ServingOptions(), precision, profile, overwrite, store,
                     cpu_precision)
    report = BackboneExportReport(str(plan.repo), {}, {}, {}, 0.0)
    with atomic_directory(plan.repo, private=(ADMIN_KEY_FILE,)) as tmp:  # the key: 0600, the rest one mode
        precision = _export_graphs(plan, tmp, report)
        if plan.keep_tasks is not None and plan.cpu_precision == "int8":
            _check_kept_tasks_int8(plan.keep_tasks, tmp / MODELS_DIR / "backbone" / "1" / INT8_GRAPH)
        _write_repository(plan, tmp, _record(plan, precision, report))
        report.sizes = {p.relative_to(tmp).as_posix(): p.stat().st_size
                        for pattern in ("*.onnx", f"{ENCODER_DIR}/*.safetensors") for p in tmp.rglob(pattern)}
        report.sizes["tasks/embeddings.npy"] = (tmp / STORE_DIR / "embeddings.npy").stat().st_size
    report.seconds = round(time.perf_counter() - start, 2)
    return report


def _validate(model: str, repo: Path, options: ServingOptions, precision: str | None, profile: Profile | None,
              overwrite: bool, store: str | None = None, cpu_precision: str = "fp32") -> ExportPlan:
    """Every refusal that can come before anything is written (the options, the folder, the backbone against the
    tasks a re-export keeps), and what follows from the backbone: `options.buckets` within its limit, the
    precision, the TensorRT profile."""
    if precision not in (None, "fp32", "fp16"):
        raise RepositoryError(f"unknown precision {precision!r}: expected fp32 or fp16")
    if precision is not None and options.engine == "torch":
        raise RepositoryError("--precision applies to --format onnx and tensorrt (the torch engine runs fp16 on CUDA "
                              "and fp32 on CPU)")
    if options.bias_interface != "rows" and options.engine == "torch":
        raise RepositoryError(f"--bias-interface {options.bias_interface} applies to --format onnx and tensorrt (the "
                              "torch engine gathers each token's row from its pool inside the backbone step)")
    if cpu_precision not in CPU_PRECISIONS:
        raise RepositoryError(f"unknown CPU precision {cpu_precision!r}: expected one of {', '.join(CPU_PRECISIONS)}")
    if cpu_precision == "int8" and options.engine == "torch":
        raise RepositoryError("int8 applies to the ONNX graphs (--format onnx or tensorrt); the torch engine runs "
                              "fp32 on CPU")
    explicit = precision is not None
    if precision is None:
        precision = {"onnx": "fp16", "tensorrt": "fp32", "torch": None}[options.engine]
    keep_tasks = None
    if repo.exists() and any(repo.iterdir()):
        if not overwrite:
            raise RepositoryError(f"{repo} already exists; pass --overwrite to replace its backbone")
        if not (repo / RECORD).is_file():
            raise RepositoryError(f"{repo} exists and is not an AoT model repository; refusing to replace it")
        keep_tasks = read_repository(repo, older=True)  # a re-export also upgrades an older repository
    backbone = load_backbone(model)
    # The longest sequence the repository serves: the encoder's limit, or, for encoders without one (relative
    # positions), the longest bucket.
    longest = backbone.max_positions or max(options.buckets)
    if max(options.buckets) > longest:  # no bucket may pad a sequence past what the encoder accepts
        options.buckets = tuple(sorted({b for b in options.buckets if b < longest} | {longest}))
    profile = profile or Profile(max_batch=options.max_batch_size, max_seq=max(options.buckets))
    max_seq = min(profile.max_seq, max(options.buckets))
    profile = dataclasses.replace(profile, max_seq=max_seq, opt_seq=min(profile.opt_seq, max_seq))
    if keep_tasks is not None and keep_tasks.fingerprint != backbone.fingerprint:
        raise RepositoryError(f"{repo} holds tasks for backbone {keep_tasks.model!r} ({keep_tasks.fingerprint}); "
                              f"{model!r} is {backbone.fingerprint}: export into a new repository")
    kept_url = keep_tasks.store_url if keep_tasks is not None else None
    if store is not None:
        if not is_s3_url(store):
            raise RepositoryError(f"--store {store!r}: expected s3://BUCKET/PREFIX (without it, the tasks live in "
                                  "the repository)")
        parse_s3_url(store)
        if keep_tasks is not None and store != kept_url:
            raise RepositoryError(f"{repo} keeps its tasks in {kept_url or 'the repository'}; a re-export keeps "
                                  f"them there: export into a new repository to use {store}")
    if keep_tasks is not None and cpu_precision == "int8":
        _check_kept_tasks_int8(keep_tasks)
    return ExportPlan(repo, backbone, options, precision, explicit, profile, longest, keep_tasks, store or kept_url,
                      cpu_precision)


def _check_kept_tasks_int8(repo: RepositoryInfo, graph: Path | None = None) -> None:
    """A re-export to int8 keeps the store's tasks: each must have been scored through an int8 engine when it was
    published (aot.exporter.accuracy_gate), or it would start serving a lower score unchecked; once the new int8 `graph`
    is written, on that very graph (its sha256, `served_dev.graph`), since another graph (another ONNX Runtime,
    exporter or bias interface) answers a little differently and a task near its allowed drop could pass it. Checked
    without `graph` before the export, so that a repository of fp32 tasks is refused before any graph is built."""
    digest = file_digest(graph) if graph is not None else None
    refused = []
    for entry in TaskStore.of(repo).entries().values():
        scored = entry.meta.get("served_dev") or {}
        if scored.get("precision") != "int8" or (digest is not None and scored.get("graph") != digest):
            refused.append(entry.name)
    if refused:
        what = ("never scored through an int8 engine" if digest is None
                else "scored on another int8 graph than this export writes")
        raise RepositoryError(f"{repo.path} holds tasks {what} ({', '.join(refused)}); nothing was replaced: export "
                              "into a new repository (--precision int8) and publish the tasks there, where each is "
                              "scored on its dev examples")


def _export_graphs(plan: ExportPlan, tmp: Path, report: BackboneExportReport) -> str | None:
    """The engine's files into `tmp`: the torch engine's weights, or both backbone graphs (TensorRT: their plans or
    build_engines.sh; ONNX Runtime in fp16: their fp16 twins), each checked against PyTorch in `report`. Returns the
    GPU precision the graphs kept (an fp16 twin out of parity falls back to fp32, or refuses when fp16 was asked)."""
    backbone, options, profile, precision = plan.backbone, plan.options, plan.profile, plan.precision
    models = tmp / MODELS_DIR
    trt_models = {}
    if options.engine == "torch":
        report.max_abs_diff["torch"] = export_torch_encoder(backbone, tmp / ENCODER_DIR)
    for name, aot in GRAPHS if options.engine != "torch" else ():
        graph = export_backbone_graph(backbone, models / name / "1", aot, interface=options.bias_interface)
        report.max_abs_diff[name] = graph.max_abs_diff
        report.fused_ops[name] = graph.fused_ops
        if plan.cpu_precision == "int8":
            quantize_graph(graph.optimized, graph.optimized.with_name(INT8_GRAPH))
            report.max_abs_diff[f"{name}-int8"] = diff = int8_difference(
                graph.optimized.with_name(INT8_GRAPH), backbone, aot, options.bias_interface)
            check_int8(diff, name)
        inputs = protocol.token_inputs(backbone.uses_token_type_ids)
        if aot:
            inputs += protocol.bias_inputs(options.bias_interface)
        trt_models[name] = {"shapes": profile.shapes(inputs, backbone.num_layers, backbone.hidden_size)}
        if options.engine == "tensorrt":
            feeds = example_inputs(backbone, aot, batch=3, seq=min(13, profile.max_seq), seed=7,
                                   interface=options.bias_interface)
            write_parity_data(graph.raw, {k: v.numpy() for k, v in feeds.items()}, graph.raw.parent)
            try:
                build_plan(graph.raw, graph.raw.with_name("model.plan"), trt_models[name]["shapes"],
                           precision == "fp16")
            except RuntimeError as exc:
                report.notes.append(f"{name}: {exc}")
        else:
            graph.raw.unlink()
    if options.engine == "tensorrt":
        script = tmp / "build_engines.sh"
        script.write_text(build_script(trt_models, precision == "fp16"))
        script.chmod(0o755)
    if options.engine == "onnx" and precision == "fp16":
        precision = _write_fp16_twins(backbone, models, report, plan.explicit, options)
    return precision


def _record(plan: ExportPlan, precision: str | None, report: BackboneExportReport) -> BackboneRecord:
    """The repository's record, built once here: what every served step and tool reads of it."""
    backbone, options = plan.backbone, plan.options
    return BackboneRecord(
        backbone=backbone_identity(backbone), uses_token_type_ids=backbone.uses_token_type_ids,
        num_layers=backbone.num_layers, hidden_size=backbone.hidden_size,
        vocab_size=int(backbone.embeddings.shape[0]),
        type_vocab_size=int(getattr(backbone.encoder.config, "type_vocab_size", 0) or 0),
        max_positions=plan.longest, store=STORE_DIR, tokenizer=TOKENIZER_DIR,
        encoder=ENCODER_DIR if options.engine == "torch" else None, serving=options, precision=precision,
        tensorrt_profile=dataclasses.asdict(plan.profile) if options.engine == "tensorrt" else None,
        parity_max_abs_diff=report.max_abs_diff, task_store_url=plan.store_url, cpu_precision=plan.cpu_precision,
        quantization=dict(QUANTIZATION) if plan.cpu_precision == "int8" else None)


def _write_repository(plan: ExportPlan, tmp: Path, record: BackboneRecord) -> None:
    """Everything else of the repository into `tmp`, beside the graphs: the tokenizer, the configs (refused, with
    nothing written, when one would not load), the task store (the replaced repository's, hard-linked, or a new
    one), the record, compose.env and the admin key (the replaced repository's, or a new one)."""
    backbone, models = plan.backbone, tmp / MODELS_DIR
    backbone.tokenizer.save_pretrained(tmp / record.tokenizer)
    _copy_python_models(models, write_configs(models, record))
    problems = check_configs(models) + check_configs(models, CPU_CONFIG)
    if problems:
        raise RepositoryError("the generated configs would not load; nothing was written:\n  " + "\n  ".join(problems))
    if plan.keep_tasks is not None:
        # Hard links: no data is copied, and the old store stays whole until the swap succeeds.
        # Its objects are never changed in place, only replaced or created, so the links stay the old store's.
        shutil.copytree(plan.keep_tasks.store_root, tmp / record.store, copy_function=os.link,
                        ignore=shutil.ignore_patterns(f"{LEGACY_STAGING_PREFIX}*", STAGING, LOCK, ROWS_DIR))
    # a new store, or the kept one (upgraded from format v1 if it is one)
    TaskStore(tmp / record.store, plan.store_url).create(record.backbone,
                                                         backbone.embeddings.detach().float().numpy())
    write_rows_graphs(tmp / record.store, backbone.num_layers, backbone.hidden_size)
    write_json(tmp / RECORD, record.to_json())
    write_compose_env(tmp, RepositoryInfo(tmp, record))
    write_admin_key(tmp, plan.repo if plan.repo.is_dir() else None)
