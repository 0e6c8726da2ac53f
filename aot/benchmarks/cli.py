"""`aot bench overhead | serve | tax | tasks | kinds | accuracy | infinity | s3 | gpu-perf | hardening | train-many`:
a command this package brings to `aot` as a plugin (entry point `bench` of the group `aot.commands` in
pyproject.toml; aot.cli.main loads it), so that imports flow one way: benchmarks -> aot, never back."""

from __future__ import annotations

import argparse

from aot.benchmarks.runs import (
    run_accuracy,
    run_gpu_perf,
    run_hardening,
    run_infinity,
    run_kinds,
    run_overhead,
    run_s3,
    run_serve,
    run_tasks,
    run_tax,
)
from aot.benchmarks.train.many import add_train_many
from aot.cli.arguments import add_command_group
from aot.cli.arguments import ints as _ints
from aot.cli.arguments import names as _names
from aot.cli.arguments import non_negative_int as _non_negative_int
from aot.cli.arguments import positive_int as _positive_int
from aot.serving.protocol import POOLINGS
from aot.serving.store.reader import STORAGES

TASK_HELP = "an AoT task artifact (fc or kron)"
PRECISIONS = ("fp32", "int8")


def _some_of(known: tuple[str, ...], what: str):
    """An argparse type: a comma-separated list of some of `known` (a value outside them names itself and them)."""
    def parse(value: str) -> list[str]:
        chosen = _names(value)
        bad = [v for v in chosen if v not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}: expected some of {', '.join(known)}")
        return chosen
    return parse


def _add_out(parser, stem: str) -> None:
    parser.add_argument("--out", required=True, help=f"output folder ({stem}.json, {stem}.md, {stem}.png)")


def _add_served_task(parser, stem: str) -> None:
    """What the benches through the local tritonserver start from: a task, their outputs, a scratch repository."""
    parser.add_argument("--task", required=True, help=TASK_HELP)
    _add_out(parser, stem)
    parser.add_argument("--repo", default=None, help="scratch repository to use (its tasks are replaced); default: a "
                                                     "temporary one")


def _finish(parser, run) -> None:
    """Every bench ends alike: --no-progress, then the function that runs it."""
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(run=run)


def add_bench(sub) -> None:
    kinds = add_command_group(sub, "bench",
                              help="benchmarks: inference overhead, serving, the serving tax, many tasks, kinds, "
                                   "accuracy sweep, the S3 store")

    o = kinds.add_parser("overhead",
                         help="inference time of each multi-task method relative to the plain model (paper Fig. 3)",
                         description="Times vanilla, AoT (fused, factored), unfused LoRA, adapters, P-Tuning v1/v2 "
                                     "side by side in one process (rotating order) and writes overhead.json, "
                                     "overhead.md and overhead.png. --engine onnxruntime times the exported graphs "
                                     "instead (vanilla, AoT in the rows and the dense bias interface).")
    o.add_argument("--models", type=_names, default=["minilm"],
                   help="minilm (real weights), local model folders, and/or random models of shape bert-base, "
                        "roberta-base, roberta-large, deberta-v2-xlarge")
    o.add_argument("--batch", type=_ints, default=[1, 16, 64], help="batch sizes")
    o.add_argument("--seq", type=_ints, default=[64, 128, 384], help="sequence lengths")
    o.add_argument("--methods", type=_names, default=None, help="subset of methods (vanilla is always run)")
    o.add_argument("--engine", choices=["torch", "onnxruntime"], default="torch",
                   help="torch: every method in PyTorch; onnxruntime: the exporter's graphs, AoT as aot-fused (rows + "
                        "index) and aot-dense (dense bias); on cpu through the server's lookup and batching code, "
                        "on cuda the fp16 graphs with the table and inputs in device memory (needs onnxruntime-gpu)")
    o.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the models run")
    o.add_argument("--cuda-graphs", action="store_true", help="torch on cuda: replay each method as a CUDA graph")
    o.add_argument("--dtype", choices=["auto", "fp32", "fp16", "bf16"], default="auto", help="auto: fp16 on cuda")
    o.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="--engine onnxruntime on cpu: the fp32 graphs, or their int8 twins (aot export backbone "
                        "--precision int8), run one request at a time as the CPU configs run them")
    o.add_argument("--threads", type=_non_negative_int, default=0,
                   help="--engine onnxruntime on cpu: ONNX Runtime threads of each graph (0: what one instance of "
                        "the CPU server's fused step runs with the repository defaults, the cores divided among "
                        "--cpu-instances' default). Above 1, idle threads sleep between operators as served, and "
                        "waking them costs the AoT graph's small operators more than their work at batch 1")
    o.add_argument("--rank", type=_positive_int, default=8, help="LoRA rank (and FC rank of aot-factored)")
    o.add_argument("--adapter-rank", type=_positive_int, default=64, help="bottleneck width of the adapters")
    o.add_argument("--prompt-length", type=_positive_int, default=20, help="p of P-Tuning v1/v2")
    o.add_argument("--warmup", type=_positive_int, default=3, help="untimed runs before each measurement")
    o.add_argument("--repeats", type=_positive_int, default=20, help="timed runs per measurement (median)")
    _add_out(o, "overhead")
    _finish(o, run_overhead)

    s = kinds.add_parser("serve",
                         help="end to end through the local tritonserver: AoT vs vanilla ensembles, memory, latency",
                         description="Builds a repository from one task artifact (or uses a scratch --repo), "
                                     "publishes N copies of the task, and measures start-up, RSS, throughput and "
                                     "p50/p99 latency of the AoT ensemble (1 and 8 mixed tasks) against the vanilla "
                                     "ensemble; writes serve.json, serve.md and serve.png.")
    _add_served_task(s, "serve")
    s.add_argument("--tasks", type=_ints, default=[1, 8, 32], help="task counts for the memory measurement")
    s.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="concurrent clients, one measurement each")
    s.add_argument("--storage", type=_some_of(STORAGES, "storage"), default=list(STORAGES),
                   help="task storages measured")
    s.add_argument("--requests", type=_positive_int, default=200, help="requests per measurement")
    s.add_argument("--rounds", type=_positive_int, default=3,
                   help="passes of each ensemble at each concurrency, in rotating order after one untimed pass of "
                        "each; the report gives their medians (one pass each drifted by up to ~10 %% between passes "
                        "of the same server: docs/benchmarks.md, 'int8 on CPU')")
    s.add_argument("--precision", type=_some_of(PRECISIONS, "precision"), default=["fp32"],
                   help="CPU graphs of the repositories the bench exports, measured one after the other in this run: "
                        "fp32, int8 or fp32,int8 (each int8 row also shows its throughput x fp32's)")
    s.add_argument("--engine", choices=["onnx", "torch"], default="onnx",
                   help="backbone engine of the repository the bench exports (ignored for an existing --repo)")
    s.add_argument("--device", default="cpu", help="aot serve --device: cpu, or cuda (torch engine)")
    s.add_argument("--pool-bytes", type=_non_negative_int, default=None,
                   help="aot serve --pool-bytes: the task pool's budget (default: the repository's); below the tasks' "
                        "tables, the 8 mixed tasks are served from a pool that cannot hold them all")
    _finish(s, run_serve)

    x = kinds.add_parser("tax",
                         help="the serving tax: CPU per request of tritonserver and each step vs the engine alone",
                         description="Serves 8 copies of one task on the local tritonserver and measures, at each "
                                     "concurrency, req/s, p50/p99 and the CPU microseconds per request of "
                                     "tritonserver and of each python step (from /proc) for the vanilla ensemble and "
                                     "AoT with 1 and 8 mixed tasks, each with text and with token ids tokenized by "
                                     "the client; beside them the engine alone (the vanilla graph, no server) on "
                                     "the same texts at each batch size, and each process's ceiling on a --cores "
                                     "host; each --cpu-instances layout on a server of its own. Clients are Python "
                                     "threads in this process; their CPU is reported. Writes tax.json, tax.md and "
                                     "tax.png. --engine torch measures the GPU configs' request path instead (see "
                                     "--engine).")
    x.add_argument("--task", default=None, help=TASK_HELP + " (required but with --engine torch, where it replaces "
                                                            "the negligible encoder by this task's)")
    _add_out(x, "tax")
    x.add_argument("--repo", default=None, help="scratch repository to use (its tasks are replaced); default: a "
                                                "temporary one")
    x.add_argument("--concurrency", type=_ints, default=None,
                   help="concurrent clients, one pass each (default: 1,8,32; --engine torch: 8,32)")
    x.add_argument("--requests", type=_positive_int, default=600, help="requests per pass (and sequences the "
                                                                       "engine alone runs at each batch size)")
    x.add_argument("--batch", type=_ints, default=[1, 8, 32], help="batch sizes of the engine alone")
    x.add_argument("--cores", type=_positive_int, default=16, help="cores of the host the ceilings are stated for")
    x.add_argument("--cpu-instances", type=_ints, default=[1, 2],
                   help="instances of the fused CPU step (aot export backbone --cpu-instances), each layout measured "
                        "on a server of its own; each instance's engine gets this host's cores divided among them")
    x.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="the CPU graphs: fp32, or int8 (a repository exported with --precision int8, or --repo one; "
                        "the engine alone then runs the int8 twins one request at a time, as the CPU configs do)")
    x.add_argument("--engine", choices=["onnx", "torch"], default="onnx",
                   help="torch: the GPU configs' request path on this CPU (the torch engine's fused step, max batch "
                        "128, 8 tasks mixed) serving, unless --task, an encoder whose compute is negligible (1 "
                        "layer, hidden 64, random weights, MiniLM's tokenizer: built in code), so that the path's "
                        "own CPU is measured: per text and per request, tritonserver's, each step instance's, the "
                        "rest's, the engines' own (aot_engine_cpu_us_total) and outside the engine, for each "
                        "--clients, --texts-per-request and --concurrency; writes tax-torch.json and .md with issue "
                        "52's targets evaluated")
    x.add_argument("--texts-per-request", type=_ints, default=[1, 64],
                   help="--engine torch: texts each request carries (aot.Client.infer_many's pack), one pass each")
    x.add_argument("--texts", type=_positive_int, default=2048, help="--engine torch: texts a pass")
    x.add_argument("--min-requests", type=_positive_int, default=128,
                   help="--engine torch: requests a pass makes at least (a pass of large requests gets more texts)")
    x.add_argument("--clients", type=_some_of(("text", "ids", "mixed"), "clients"), default=["text", "ids"],
                   help="--engine torch: who sends: text (TEXT + TASK), ids (aot.Client(tokenizer=...) sends token "
                        "ids: the server's CPU without its tokenizer's), mixed (both at once, half the requests in "
                        "flight each); one pass each")
    x.add_argument("--no-probes", action="store_true",
                   help="--engine torch: serve without the supervisor, so without its liveness probes (what they "
                        "cost the server)")
    _finish(x, run_tax)

    t = kinds.add_parser("tasks",
                         help="serving 1 to 1,000 tasks through the local tritonserver: fused + mmap, factored, pool",
                         description="Derives N tasks from one artifact (independently perturbed factors), publishes "
                                     "them, and measures throughput, p50/p99 latency, server RSS, pool hit rate and "
                                     "start-up of three storages side by side, each on a fresh server: fused-mmap, "
                                     "factored (rows per request), pool (factored rows cached in the task pool). "
                                     "Writes tasks.json, tasks.md and tasks.png.")
    t.add_argument("--task", required=True, help=TASK_HELP)
    t.add_argument("--counts", type=_ints, default=[1, 10, 100, 1000], help="numbers of tasks served")
    t.add_argument("--popularity", type=_names, default=["zipf", "uniform"],
                   help="how requests pick tasks: zipf (task k with probability ~1/k) and/or uniform")
    t.add_argument("--pool-bytes", type=_positive_int, default=None,
                   help="task pool budget of the pool mode (default: what 8 fused tables take)")
    t.add_argument("--concurrency", type=_positive_int, default=8, help="concurrent clients")
    t.add_argument("--requests", type=_positive_int, default=400, help="measured requests per run (after as many "
                                                                       "warm-up requests)")
    t.add_argument("--modes", type=_names, default=["fused-mmap", "factored", "pool"], help="storages measured side by side")
    t.add_argument("--repeats", type=_positive_int, default=1,
                   help="runs of each configuration, each on a fresh server, interleaved; the median is reported "
                        "(this machine's run-to-run noise is 3-15 %%); --scale: fresh servers at each count, the "
                        "median and each run's figures (their spread) reported")
    t.add_argument("--policy-requests", type=int, default=20000,
                   help="requests of the trace replayed through the pool per eviction policy (lru, lfu), in-process, "
                        "with the largest task count; 0 skips it")
    t.add_argument("--warmup", type=_positive_int, default=None,
                   help="--scale: warm-up requests before each measured run (default: as many as --requests); a "
                        "longer warm-up measures the steady state, a short one includes more first loads")
    t.add_argument("--scale", action="store_true",
                   help="instead: one server and a store growing through --counts (e.g. 1,100,1000,10000) of "
                        "derived factored tasks (and fused ones for their cold first requests), as `aot serve` runs "
                        "them by default: start-up, memory of every server process (RSS, PSS) and by instance count, "
                        "cold first requests idle and under load, Zipf against one hot task, publishing while serving "
                        "and its cost as the store grows, sampled answers against PyTorch, the version cache's policy "
                        "against LRU (scale.json, scale.md, scale.png; --requests measured after as many warm-up "
                        "requests, --concurrency clients, --repeats fresh servers per count)")
    _add_out(t, "tasks")
    _finish(t, run_tasks)

    k = kinds.add_parser("kinds", help="served speed: 8 tasks of mixed kinds against 8 classifiers, one server",
                         description="Makes 16 AoT tasks on one encoder (seeded random factors and heads): 8 "
                                     "classifiers, and 3 classifiers, 2 token taggers, 2 embeddings and 1 multi-label "
                                     "task; serves them on one local tritonserver, checks the answers against aot "
                                     "predict, then measures both sets alternately (closed loop) and writes "
                                     "kinds.json and kinds.md with the ratio of their median throughputs.")
    k.add_argument("--model", default="minilm", help="local model folder or 'minilm'")
    k.add_argument("--requests", type=_positive_int, default=400, help="requests per pass")
    k.add_argument("--concurrency", type=_positive_int, default=8, help="clients in the closed loop")
    k.add_argument("--repeats", type=_positive_int, default=3, help="measured passes per set")
    k.add_argument("--max-length", type=_positive_int, default=64, help="tokens per input of every task")
    k.add_argument("--check", type=_non_negative_int, default=8,
                   help="texts per task whose served answers are compared with aot predict's")
    _add_out(k, "kinds")
    _finish(k, run_kinds)

    a = kinds.add_parser("accuracy",
                         help="sweep methods over a small grid from the paper's Table 2, then retrain over seeds",
                         description="For each dataset and method: train every grid point (seed 0), pick the best on "
                                     "dev, retrain it with --seeds seeds, report test median ± std. Results are "
                                     "written per run (atomically); a rerun skips finished runs.")
    a.add_argument("--model", required=True, help="local model folder or 'minilm'")
    a.add_argument("--data", required=True, type=_names, help="comma-separated datasets (built-in names or folders)")
    a.add_argument("--methods", type=_names, default=_names("fc,kron,bitfit,lora,prefix,prompt,adapter,full"),
                   help="methods compared")
    a.add_argument("--seeds", type=_positive_int, default=3, help="seeds for the best setting of each method")
    a.add_argument("--grid", choices=["small", "paper", "defaults"], default="small",
                   help="hyperparameter grid (defaults: each method's default learning rate and rank, batch 16, as `aot "
                        "train` uses them with no flags)")
    a.add_argument("--out", required=True, help="output folder (accuracy.json, accuracy.md, accuracy.png, runs/)")
    a.add_argument("--max-train-samples", type=_positive_int, default=None, help="seeded train subset per dataset")
    a.add_argument("--max-length", type=_positive_int, default=128, help="tokens per input")
    a.add_argument("--budget", choices=["epochs", "steps"], default="epochs",
                   help="epochs: up to --epochs with early stopping (--patience); steps: exactly --steps optimizer "
                        "steps for every method, no early stopping")
    a.add_argument("--steps", type=_positive_int, default=100, help="the steps budget (--budget steps)")
    a.add_argument("--epochs", type=_positive_int, default=3, help="the epochs budget (--budget epochs)")
    a.add_argument("--patience", type=_positive_int, default=3, help="early stopping (--budget epochs)")
    a.add_argument("--eval-every", type=int, default=0,
                   help="steps between dev evaluations (0: once per epoch; with --budget steps, steps/10)")
    a.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="what every task's head reads (default: what the model declares, as aot train does)")
    a.add_argument("--workers", type=_positive_int, default=1, help="parallel training processes")
    _finish(a, run_accuracy)

    i = kinds.add_parser("infinity", help="aot serve against Infinity on the same encoder and texts, fp32 and int8",
                         description="Serves the task's encoder with Infinity (michaelfeil/infinity, its ONNX Runtime "
                                     "engine, mean pooling; installed in an environment of its own, e.g. `python -m "
                                     "venv V && V/bin/pip install torch==2.13.0 'infinity_emb[server,optimum]==0.0.78'`"
                                     ") and the task with aot serve (`aot bench serve`: AoT, 8 tasks mixed, "
                                     "vanilla), each precision in turn, through one closed loop at each concurrency; "
                                     "writes infinity.json and infinity.md (and aot-serve/).")
    i.add_argument("--task", required=True, help="an AoT task artifact of the MiniLM (or any encoder Infinity loads)")
    i.add_argument("--infinity", required=True, help="the infinity_emb executable of Infinity's own environment")
    i.add_argument("--precision", type=_some_of(PRECISIONS, "precision"), default=["fp32", "int8"],
                   help="fp32, int8 or fp32,int8")
    i.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="concurrent clients, one measurement each")
    i.add_argument("--requests", type=_positive_int, default=1000, help="requests per measurement")
    _add_out(i, "infinity")
    _finish(i, run_infinity)

    g = kinds.add_parser("gpu-perf",
                         help="the GPU check's perf stage: per model shape, the engine alone and served through aot "
                              "serve under perf_analyzer, against issue 52's targets",
                         description="For each --shape (an AoT task trained on a random encoder of that shape): the "
                                     "engine alone at the served max batch (aot bench overhead), then a repository "
                                     "exported with --format torch serving 8 copies of the task (aot serve --vanilla) "
                                     "measured by perf_analyzer: vanilla, AoT 1 task and AoT 8 mixed tasks at each "
                                     "--concurrency with each --texts-per-request, the GPU's utilisation (nvidia-smi) "
                                     "through each window, py-spy of one step instance through --profile-window "
                                     "(with --py-spy); then the batches run eagerly (/metrics), /ready's "
                                     "warnings and parity with aot predict. Writes perf.json and perf.md; exits 1 "
                                     "when a measured batch ran eagerly, served answers are off or a shape could "
                                     "not be served (scripts/gpu-check.sh perf runs it).")
    g.add_argument("--shape", action="append", required=True, metavar="NAME=TASK",
                   help="a shape to measure: its name and an AoT task trained on its encoder; repeatable, measured in "
                        "order (the p50 target applies to the shape named minilm)")
    g.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="aot serve --device (cpu: a rehearsal)")
    g.add_argument("--perf-analyzer", default=None, metavar="PATH",
                   help="perf_analyzer's binary (needed on cuda); without it a stand-in load generator "
                        "(aot.Client.infer_many) runs each window, labelled as such")
    g.add_argument("--concurrency", type=_ints, default=[1, 32, 256], help="requests in flight, one window each")
    g.add_argument("--texts-per-request", type=_ints, default=[1, 64], help="texts a request carries (-b)")
    g.add_argument("--max-batch-size", type=_positive_int, default=128,
                   help="aot export backbone --max-batch-size of the served repository")
    g.add_argument("--seq", type=_positive_int, default=64,
                   help="the engine alone's sequence length, a served bucket: served texts pad to it")
    g.add_argument("--gpu-instances", type=_positive_int, default=None,
                   help="aot export backbone --gpu-instances of the served repository (default: the export's)")
    g.add_argument("--measurement-interval", type=_positive_int, default=1500,
                   help="perf_analyzer's window (ms); a window whose requests take long gets a longer one (two "
                        "requests' latency, estimated from the rate measured at its request size, at most 8 s)")
    g.add_argument("--py-spy", default=None, metavar="PATH",
                   help="py-spy's binary: profile one instance of the step through --profile-window of the first "
                        "shape (py-spy.txt beside perf.md, summarised in it)")
    g.add_argument("--profile-window", default="aot-8-t64-c256", metavar="WINDOW",
                   help="the window py-spy samples: MODEL-tTEXTS-cCONCURRENCY, MODEL vanilla, aot-1 or aot-8")
    g.add_argument("--stand-in-requests", type=_positive_int, default=8,
                   help="without --perf-analyzer: requests of each window")
    g.add_argument("--engine-batch", type=_positive_int, default=None,
                   help="the engine alone's batch (default: --max-batch-size)")
    g.add_argument("--engine-repeats", type=_positive_int, default=20, help="timed runs of the engine alone (median)")
    g.add_argument("--deadline", type=float, default=None, metavar="UNIX_TIME",
                   help="end by then: windows (least important first) and shapes that would not fit are skipped "
                        "and named in the report")
    g.add_argument("--note", action="append", default=[], help="a line for the report's notes; repeatable")
    g.add_argument("--work", default=None,
                   help="folder of the served repositories (GBs with a base-size encoder; removed after each shape); "
                        "default: a temporary one")
    _add_out(g, "perf")
    _finish(g, run_gpu_perf)

    b = kinds.add_parser("s3", help="the task store in S3-compatible object storage against the file store",
                         description="A SeaweedFS started here (aot.local.s3_server) holds a store of tasks derived from "
                                     "--task: cached req/s against the file store, a replica's start with 1 and with "
                                     "--tasks tasks in the bucket, first requests of cold tasks, the store stopped "
                                     "under load, publishing to a fleet of 2 (s3.json, s3.md)")
    b.add_argument("--task", required=True, help=TASK_HELP)
    b.add_argument("--out", required=True, help="output folder (s3.json, s3.md)")
    b.add_argument("--tasks", type=_positive_int, default=10000, help="tasks in the bucket for the start and the "
                                                                      "cold requests")
    b.add_argument("--requests", type=_positive_int, default=800, help="measured requests per closed loop (after as "
                                                                       "many warm-up requests)")
    b.add_argument("--concurrency", type=_positive_int, default=8, help="concurrent clients")
    b.add_argument("--pause", type=float, default=30.0, help="seconds the store is stopped under load")
    _finish(b, run_s3)

    h = kinds.add_parser("hardening", help="issue 46's figures: a hung store, unknown tasks, a damaged shard, a large "
                                           "change",
                         description="Through real servers on tasks of --task: a SeaweedFS store stopped (SIGSTOP) "
                                     "under load on a cached task beside a cold one (answers, failures, p99, "
                                     "/ready); one unknown-task request at each --counts of tasks; a client's p99 "
                                     "beside clients sending made-up names; one change of the largest count applied "
                                     "under load; a server's start on an intact store and on one with a truncated "
                                     "shard (hardening.json, hardening.md)")
    h.add_argument("--task", required=True, help=TASK_HELP)
    h.add_argument("--out", required=True, help="output folder (hardening.json, hardening.md)")
    h.add_argument("--counts", type=_ints, default=[1000, 10000, 100000], help="tasks in the store")
    h.add_argument("--pause-s", type=float, default=12.0, help="seconds the object store is stopped under load")
    _finish(h, run_hardening)
    add_train_many(kinds)
