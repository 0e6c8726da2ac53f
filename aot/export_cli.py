"""`aot export backbone | task | remove | list`."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from aot.arguments import ints, non_negative_int, positive_int
from serving.protocol import BIAS_INTERFACES


def add_export(sub) -> None:
    p = sub.add_parser("export", help="export a backbone or a task into a Triton model repository",
                       description="Write the shared backbone (once) and tasks (any number) into a model repository.")
    kinds = p.add_subparsers(dest="export_command", required=True, metavar="WHAT")

    b = kinds.add_parser("backbone", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         help="export the frozen encoder (AoT and vanilla graphs), tokenizer and serving steps",
                         description="Create a model repository: ONNX graphs of the encoder with and without AoT "
                                     "bias inputs (validated against PyTorch), the tokenizer, lookup and head steps, "
                                     "the ensembles, GPU configs (config.pbtxt) and CPU configs (configs/cpu.pbtxt), "
                                     "and an empty task store.")
    b.add_argument("--model", required=True, help="local Hugging Face model folder or 'minilm'")
    b.add_argument("--repo", required=True, help="model repository folder to create")
    b.add_argument("--format", choices=["onnx", "tensorrt", "torch"], default="onnx",
                   help="engine of the backbone: onnx (the NGC image's onnxruntime backend; locally ONNX Runtime on "
                        "CPU), tensorrt (a TensorRT plan, built here if tensorrt is importable, else by the "
                        "engine-builder service of docker-compose.yml), or torch (PyTorch in a "
                        "python step, fp16 + CUDA graphs on a GPU: `aot serve --device cuda` serves it with the "
                        "local tritonserver)")
    b.add_argument("--precision", choices=["fp32", "fp16"], default=None,
                   help="precision of the GPU backbone (CPU configs always run fp32). Default: fp16 for onnx where "
                        "the fp16 graph keeps parity with PyTorch (within 5e-2 on the pooled states; else fp32, "
                        "with a note), fp32 for tensorrt (fp16: trtexec --fp16, checked by Polygraphy on the GPU); "
                        "the torch engine takes none (fp16 on CUDA)")
    b.add_argument("--max-batch-size", type=positive_int, default=32, help="Triton max_batch_size of every step")
    b.add_argument("--queue-delay-us", type=non_negative_int, default=500,
                   help="backbone dynamic-batching queue delay (µs)")
    b.add_argument("--cpu-threads", type=non_negative_int, default=0,
                   help="ONNX Runtime threads of the CPU backbone (0: all)")
    b.add_argument("--buckets", type=ints, default=[16, 32, 64, 128, 256, 512],
                   help="GPU: sequence lengths token tensors are padded to, so that requests batch together "
                        "(lengths past what the encoder accepts are replaced by its limit)")
    b.add_argument("--bias-interface", choices=list(BIAS_INTERFACES), default="rows",
                   help="native GPU backends (onnx, tensorrt): how the lookup step hands each request's bias to the "
                        "backbone: rows (the rows of its distinct tokens + each token's index: fewest bytes, ragged "
                        "shapes) or dense (an fp16 bias per token of the bucketed sequence: fixed shapes per bucket, "
                        "so TensorRT replays CUDA graphs captured for them). docs/benchmarks.md section 5 compares "
                        "them")
    b.add_argument("--pool-bytes", type=non_negative_int, default=1 << 30,
                   help="task pool: memory for rows of P kept in RAM by the lookup (0: none; `aot serve "
                        "--pool-bytes` overrides it)")
    b.add_argument("--max-text-bytes", type=positive_int, default=65536,
                   help="longest TEXT a request may send (UTF-8 bytes); longer ones are refused at once")
    b.add_argument("--opt-batch", type=positive_int, default=8, help="TensorRT profile: optimal batch")
    b.add_argument("--opt-seq", type=positive_int, default=128, help="TensorRT profile: optimal sequence length")
    b.add_argument("--overwrite", action="store_true", help="replace an existing repository's backbone (tasks kept)")
    b.set_defaults(run=run_export_backbone)

    t = kinds.add_parser("task", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         help="fuse a trained AoT task into the repository's task store",
                         description="Fuse P (or keep its factors), write the head, check the served logits against "
                                     "PyTorch, and publish the task atomically (a running server picks it up).")
    t.add_argument("--task", required=True, help="task artifact folder (from `aot train`, method fc or kron)")
    t.add_argument("--repo", required=True, help="model repository (from `aot export backbone`)")
    t.add_argument("--name", required=True, help="task id clients use")
    t.add_argument("--storage", choices=["auto", "fused", "factored"], default="auto",
                   help="fused: P as a [V, L, d] fp16 table (the paper); factored: the factors (1-2 %% of a table), "
                        "rows computed when the pool fills; auto: fused while every task of the repository fits "
                        "in its task pool, else factored (the report shows both costs)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(run=run_export_task)

    r = kinds.add_parser("remove", help="remove a task from the repository's task store")
    r.add_argument("--repo", required=True)
    r.add_argument("--name", required=True)
    r.set_defaults(run=run_export_remove)

    ls = kinds.add_parser("list", help="list the tasks of a repository")
    ls.add_argument("--repo", required=True)
    ls.set_defaults(run=run_export_list)


def run_export_backbone(args) -> int:
    from exporter.backbone_export import export_backbone
    from exporter.tensorrt import Profile
    from serving.repository import ServingOptions

    buckets = tuple(sorted(args.buckets))
    options = ServingOptions(max_batch_size=args.max_batch_size, backbone_queue_delay_us=args.queue_delay_us,
                             cpu_threads=args.cpu_threads, buckets=buckets, engine=args.format,
                             max_text_bytes=args.max_text_bytes, pool_bytes=args.pool_bytes,
                             bias_interface=args.bias_interface)
    profile = Profile(opt_batch=min(args.opt_batch, args.max_batch_size), max_batch=args.max_batch_size,
                      opt_seq=min(args.opt_seq, max(buckets)), max_seq=max(buckets))
    report = export_backbone(args.model, args.repo, options, args.precision, profile, args.overwrite)
    print(json.dumps(asdict(report)))
    return 0


def run_export_task(args) -> int:
    from exporter.task_export import export_task

    report = export_task(args.task, args.repo, args.name, args.storage, progress=not args.no_progress)
    print(json.dumps(asdict(report)))
    return 0


def run_export_remove(args) -> int:
    from exporter.task_store import TaskStore
    from serving.repository import read_repository

    TaskStore(read_repository(args.repo).store_root).remove(args.name)
    print(json.dumps({"removed": args.name}))
    return 0


def run_export_list(args) -> int:
    from exporter.task_store import TaskStore
    from serving.repository import read_repository

    for entry in TaskStore(read_repository(args.repo).store_root).entries().values():
        print(json.dumps(asdict(entry)))
    return 0
