"""`aot export backbone | task | remove | list | verify | repair | tenant | versions | rollback | route`."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import asdict

from aot.cli.arguments import (
    add_command_group,
    add_dataclass_arguments,
    dataclass_from_arguments,
    non_negative_float,
    positive_int,
)
from aot.cli.output import report
from aot.serving.repository import ServingOptions
from aot.serving.store.reader import DEFAULT_KEEP


def add_export(sub) -> None:
    kinds = add_command_group(sub, "export", help="export a backbone or a task into a Triton model repository",
                              description="Write the shared backbone (once) and tasks (any number) into a model "
                                          "repository.")

    b = kinds.add_parser("backbone",
                         help="export the frozen encoder (AoT and vanilla graphs), tokenizer and serving steps",
                         description="Create a model repository: ONNX graphs of the encoder with and without AoT "
                                     "bias inputs (validated against PyTorch), the tokenizer, lookup and head steps, "
                                     "the ensembles, GPU configs (config.pbtxt) and CPU configs (configs/cpu.pbtxt), "
                                     "and an empty task store.")
    b.add_argument("--model", required=True, help="local Hugging Face model folder or 'minilm'")
    b.add_argument("--repo", required=True, help="model repository folder to create")
    b.add_argument("--precision", choices=["fp32", "fp16", "int8"], default=None,
                   help="fp32 or fp16: precision of the GPU backbone (the CPU configs run fp32). Default: fp16 for "
                        "onnx where the fp16 graph keeps parity with PyTorch (within 5e-2 on the pooled states; else "
                        "fp32, with a note), fp32 for tensorrt (fp16: trtexec --fp16, checked by Polygraphy on the "
                        "GPU); the torch engine takes none (fp16 on CUDA). int8: the CPU configs run int8 graphs "
                        "(about twice the throughput; the GPU configs keep their default), and every task published "
                        "is scored on its dev examples through the int8 engine and refused when it falls more than "
                        "0.5 point below its fp32 score (aot export task --allow-accuracy-drop, aot train --fit-to)")
    add_dataclass_arguments(b, ServingOptions)
    b.add_argument("--opt-batch", type=positive_int, default=8, help="TensorRT profile: optimal batch")
    b.add_argument("--opt-seq", type=positive_int, default=128, help="TensorRT profile: optimal sequence length")
    b.add_argument("--overwrite", action="store_true",
                   help="replace an existing repository's backbone (tasks kept; to int8, only tasks the same int8 "
                        "graph scored)")
    b.add_argument("--store", default=None,
                   help="s3://BUCKET/PREFIX: keep the tasks in S3-compatible object storage instead of the repository "
                        "(a fleet with no shared volume: each replica fetches a task on its first request into a local "
                        "cache). Credentials, endpoint and region from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                        "AWS_ENDPOINT_URL, AWS_REGION or ~/.aws files (docs/deploy-fleet.md)")
    b.set_defaults(run=run_export_backbone)

    t = kinds.add_parser("task",
                         help="fuse a trained AoT task (or a batch of them) into the repository's task store",
                         description="Fuse P (or keep its factors), write the head, check the served logits against "
                                     "PyTorch, and publish the task atomically (a running server picks it up). With "
                                     "--batch FILE, every task FILE names, the backbone loaded once, published in one "
                                     "change: a server sees all of them or, if anything fails, none.")
    t.add_argument("--task", help="task artifact folder (from `aot train`, method fc or kron)")
    t.add_argument("--repo", required=True, help="model repository (from `aot export backbone`)")
    t.add_argument("--name", help="task id clients use")
    t.add_argument("--batch", default=None,
                   help='instead of --task/--name: a JSON-lines file of {"task": DIR, "name": NAME}, one task a line '
                        "(bad lines are named by line number before anything is written)")
    t.add_argument("--storage", choices=["auto", "fused", "factored"], default="auto",
                   help="fused: P as a [V, L, d] fp16 table (the paper); factored: the factors (1-2 %% of a table), "
                        "rows computed as they are used and kept in the task pool; auto: factored in object storage "
                        "(each replica downloads what a task stores), else fused while every task of the repository "
                        "fits in its task pool, then factored (each publish says which and why; the report shows "
                        "both costs)")
    t.add_argument("--keep", type=positive_int, default=None, metavar="N",
                   help="versions of the task to keep, this one included (default: what the task kept so far, else "
                        f"{DEFAULT_KEEP}): each stays servable as NAME@ID and a rollback target while kept; older ones "
                        "are retired (servable 5 minutes more, then deleted)")
    t.add_argument("--allow-accuracy-drop", type=non_negative_float, default=None, metavar="POINTS",
                   help="int8 repositories: publish the task even when its dev score through the int8 engine falls up "
                        "to POINTS below its fp32 score (default 0.5; the metric x 100)")
    t.add_argument("--dev-data", default=None, metavar="FILE",
                   help="int8 repositories: the dev examples the task is scored on, a split file of its kind "
                        "(JSONL/CSV/TSV: text, text_pair?, label; a tagger's CoNLL or tokens/tags JSONL); default: "
                        "the dev split of the data it was trained on")
    t.add_argument("--allow-small-dev-sample", action="store_true",
                   help="int8 repositories: publish even when fewer than 50 dev examples score the task (one flipped "
                        "example then moves its score 2 points or more; recorded as served_dev.small_sample_accepted); "
                        "under 300 the export warns how far one example moves it")
    t.add_argument("--allow-label-change", action="store_true",
                   help="publish even when the task's current version has other labels (names, order or count), "
                        "another kind or pair-ness: refused without it, both label lists shown, since consumers that "
                        "read answers by label position would break without an error")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t.set_defaults(run=run_export_task)

    r = kinds.add_parser("remove", help="remove a task from the repository's task store")
    r.add_argument("--repo", required=True, help="model repository (from `aot export backbone`)")
    r.add_argument("--name", required=True, help="task id to remove")
    r.set_defaults(run=run_export_remove)

    ls = kinds.add_parser("list", help="list the tasks of a repository",
                          description="List the task store's tasks; removes what killed exports left behind.")
    ls.add_argument("--repo", required=True, help="model repository (from `aot export backbone`)")
    ls.set_defaults(run=run_export_list)

    v = kinds.add_parser("verify", help="check every task of a repository against its published digests",
                         description="Offline: hash every file of every task version and compare with the sha256 "
                                     "digests the store's index published at export, and load each version as the "
                                     "server does. Prints one line per task; exits 1 if any task is damaged.")
    v.add_argument("--repo", required=True, help="model repository (from `aot export backbone`)")
    v.set_defaults(run=run_export_verify)
    fix = kinds.add_parser("repair", help="rebuild the task store's index from what still reads",
                           description="After a shard, a log or an index of the task store was damaged (aot export "
                                       "verify names it; servers warn and fail the tasks it held): read the newest "
                                       "index that parses, its shards and every log that parses, give the tasks "
                                       "they cannot tell an entry for their newest version folder (hashed and "
                                       "loaded first), and write that as a new index every server reads. A recovered "
                                       "task keeps only that version (not its kept versions, route or retention). "
                                       "Stop publishers first. Prints what it found and did; exits 0 when the store "
                                       "reads whole afterwards.")
    fix.add_argument("--repo", required=True, help="model repository (from `aot export backbone`)")
    fix.add_argument("--dry-run", action="store_true", help="only say what it would do (exit 1 when there is damage)")
    fix.set_defaults(run=run_export_repair)
    add_tenant_and_version_commands(kinds)


def add_tenant_and_version_commands(kinds) -> None:
    _store_command(kinds, "tenant", run_export_tenant,
                   "create, rotate, delete or list tenants (namespaces of tasks TENANT/TASK)",
                   "A tenant's tasks (named TENANT/TASK) answer only requests that carry its key (request parameter "
                   "aot-tenant-key; aot infer --tenant-key, AOT_TENANT_KEY). create and rotate print {\"tenant\", "
                   "\"key\"} once per tenant: the store keeps only the key's sha256; create makes every TENANT "
                   "given in one change (all or none). rotate stops the old key from the servers' next batch; "
                   "delete removes the tenant and all its tasks, their versions at once (a tenant created again "
                   "under the name answers none of them). list prints {\"tenant\", \"key_since\", \"tasks\"} per "
                   "tenant.",
                   ("action", {"choices": ["create", "rotate", "delete", "list"], "help": "what to do"}),
                   ("tenants", {"metavar": "TENANT", "nargs": "*",
                                "help": "tenant name(s) (letters, digits, '_', '-', '.'); none for list"}))
    _store_command(kinds, "versions", run_export_versions, "list the versions of a task the store serves",
                   "One JSON line per version, newest first: the current one, the kept ones (servable as NAME@ID and "
                   "rollback targets) and retired ones still in their grace; with a route, each routed version's "
                   "share.", ("name", {"metavar": "NAME", "help": "task name"}))
    allow = ("--allow-label-change", {"action": "store_true",
                                      "help": "allow a version whose labels (names, order or count), kind or "
                                              "pair-ness differ from the current version's (refused without it)"})
    _store_command(kinds, "rollback", run_export_rollback, "make a kept version of a task its current version again",
                   "NAME answers VERSION (NAME@ID, as answers and `aot export versions` name it) from the servers' "
                   "next batch; the version it replaces is kept. Clears a route. A version of other labels, kind or "
                   "pair-ness than the current one is refused unless --allow-label-change; a lower dev score is "
                   "said.",
                   ("name", {"metavar": "NAME", "help": "task name"}),
                   ("version", {"metavar": "VERSION", "help": "a kept version, NAME@ID"}), allow)
    _store_command(kinds, "route", run_export_route, "split a task's requests between its kept versions (canaries)",
                   "Each request for the bare NAME is answered by one version drawn by weight (one draw per request); "
                   "every answer names its version. CURRENT names the current version: `route NAME CURRENT=90 "
                   "NAME@ID=10` sends a tenth to a canary, `route NAME CURRENT=1` (the current version alone) clears "
                   "the route; so do a new export and a rollback. A routed version of other labels, kind or pair-ness "
                   "than the current one is refused unless --allow-label-change; a lower dev score is said.",
                   ("name", {"metavar": "NAME", "help": "task name"}),
                   ("weights", {"nargs": "+", "metavar": "VERSION=WEIGHT",
                                "help": "a kept version (NAME@ID, or CURRENT) and its weight, a positive number "
                                        "(shares are weight / sum)"}), allow)


def _store_command(kinds, command: str, run, help: str, description: str, *arguments: tuple[str, dict]) -> None:
    """A subcommand that changes or reads a repository's task store: its arguments, then --repo."""
    p = kinds.add_parser(command, help=help, description=description)
    for name, options in arguments:
        p.add_argument(name, **options)
    p.add_argument("--repo", required=True, help="model repository (from `aot export backbone`)")
    p.set_defaults(run=run)


def run_export_backbone(args) -> int:
    from aot.exporter.backbone_export import export_backbone
    from aot.exporter.tensorrt import Profile

    options = dataclass_from_arguments(ServingOptions, args)
    profile = Profile(opt_batch=min(args.opt_batch, options.max_batch_size), max_batch=options.max_batch_size,
                      opt_seq=min(args.opt_seq, max(options.buckets)), max_seq=max(options.buckets))
    int8 = args.precision == "int8"
    result = export_backbone(args.model, args.repo, options, None if int8 else args.precision, profile, args.overwrite,
                             args.store, cpu_precision="int8" if int8 else "fp32")
    report(asdict(result), f"exported backbone {args.model} ({options.engine} engine) into {args.repo} in "
                           f"{result.seconds:.0f} s",
           f"next: aot export task --task TASK --repo {args.repo} --name NAME, then aot serve --repo {args.repo}")
    return 0


def run_export_task(args) -> int:
    if args.batch is not None:
        if args.task or args.name:
            raise ValueError("--batch FILE names the tasks and their names: give it without --task and --name")
        return _run_export_batch(args)
    if not args.task or not args.name:
        raise ValueError("give --task DIR and --name NAME (or --batch FILE for many tasks)")
    from aot.exporter.task_export import export_task

    result = export_task(args.task, args.repo, args.name, args.storage, progress=not args.no_progress, keep=args.keep,
                         allowed_drop=args.allow_accuracy_drop, dev_data=args.dev_data,
                         accept_small_dev=args.allow_small_dev_sample, allow_label_change=args.allow_label_change)
    served = result.served_dev
    accuracy = "" if served is None else (f"; dev {served['metric']} {served['precision']} {served['score'] * 100:.2f} "
                                          f"against fp32 {served['fp32'] * 100:.2f}")
    picked = [auto_storage_note(args.name, result.storage, result.storage_advice)] if args.storage == "auto" else []
    report(asdict(result), f"published task {args.name} ({result.storage}, {result.bytes_on_disk / 2**20:.1f} MiB, "
                           f"version {result.folder}) in {args.repo}{accuracy}: a running server answers it from its "
                           "next batch", *picked, *(f"warning: {note}" for note in result.notes),
           f'next: aot serve --repo {args.repo} (if none runs), then aot infer --task {args.name} "some text"')
    return 0


def auto_storage_note(name: str, storage: str, advice: dict) -> str:
    """Which storage `--storage auto` picked for a task and why (aot.exporter.task_export.storage_advice), said at every
    publish: the choice depends on the store and on how many tasks it holds."""
    other = "fused" if storage == "factored" else "factored"
    return (f"--storage auto stored {name} {storage} ({advice['auto_reason']}); --storage {other} stores it "
            f"{other} (docs/serving.md, the task pool)")


def _run_export_batch(args) -> int:
    from aot.exporter.batch_export import export_batch

    result = export_batch(args.repo, args.batch, args.storage, progress=not args.no_progress, keep=args.keep,
                          allow_label_change=args.allow_label_change)
    stored = Counter(r.storage for r in result.tasks)
    picked = "" if args.storage != "auto" else "; --storage auto stored " + ", ".join(
        f"{n} {storage} ({next(r.storage_advice['auto_reason'] for r in result.tasks if r.storage == storage)})"
        for storage, n in sorted(stored.items()))
    report([asdict(r) for r in result.tasks],
           f"published {len(result.tasks)} task(s) in one change of {args.repo} in {result.seconds:.1f} s "
           f"({result.tasks_per_second:.1f} tasks/s): a running server answers them from its next batch{picked}",
           *(f"warning: {note}" for r in result.tasks for note in r.notes),
           f"next: aot tasks --match NAME (on a running server), or aot serve --repo {args.repo}")
    return 0


def run_export_remove(args) -> int:
    from aot.serving.repository import read_repository
    from aot.serving.store.reader import RETIRED_GRACE
    from aot.serving.store.writer import TaskStore

    store = TaskStore.of(read_repository(args.repo))
    entry = store.remove(args.name)
    report({"removed": args.name, "folder": entry.folder},
           f"removed task {args.name} from {args.repo}: servers stop answering it from their next batch; its version "
           f"folder {entry.folder} stays on disk for {RETIRED_GRACE / 60:.0f} minutes (requests already pinned to it "
           "finish), then the first aot export task or remove on this repository deletes it")
    return 0


def _clean(store, sweep: bool = False) -> None:
    """Remove the temporary folders of exports that were killed (`sweep`: and, in object storage, their uploads);
    say so (a read-only store is left as it is)."""
    try:
        removed = store.clean(sweep)
    except OSError as exc:
        print(f"aot: warning: could not clean {store.root}: {exc.strerror}", file=sys.stderr)
        return
    if removed:
        print(f"aot: removed {len(removed)} folder(s) left by killed exports: {', '.join(removed)}", file=sys.stderr)


def run_export_list(args) -> int:
    from aot.serving.repository import read_repository
    from aot.serving.store.writer import TaskStore

    store = TaskStore.of(read_repository(args.repo))
    _clean(store)
    index = store.index()
    for damage in index.damage():  # what reads is listed; the damage is said, with the repair
        print(f"aot: warning: {damage}; run aot export repair --repo {args.repo}", file=sys.stderr)
    entries = [{"name": e.name, "folder": e.folder, "storage": e.storage, "verified": e.digests is not None,
                **({"int8_gate": gate_summary(e.meta["served_dev"])} if e.meta.get("served_dev") else {})}
               for e in index.entries.values()]
    report(entries, f"{len(entries)} task(s) in {args.repo}" + ("" if entries else
                    f"; next: aot export task --task TASK --repo {args.repo} --name NAME"))
    return 0


def gate_summary(served_dev: dict) -> dict:
    """What `aot export list` shows of a version's int8 gate (served_dev): the examples it was scored on, its drop
    and the drop accepted, and whether a small sample was accepted."""
    return {"examples": served_dev.get("examples"), "drop": served_dev.get("drop"),
            "allowed_drop": served_dev.get("allowed_drop"),
            "small_sample_accepted": bool(served_dev.get("small_sample_accepted"))}


def run_export_verify(args) -> int:
    from aot.exporter.version_check import loads_as_served
    from aot.serving.repository import read_repository
    from aot.serving.store.writer import TaskStore

    store = TaskStore.of(read_repository(args.repo))
    _clean(store, sweep=True)
    found = store.verify(loads_as_served)
    damaged = [name for name, problem in found.items() if problem]
    report([{"name": name, "ok": problem is None, **({"error": problem} if problem else {})}
            for name, problem in found.items()],
           f"{len(found) - len(damaged)} of {len(found)} task(s) sound" +
           (f"; damaged: {', '.join(damaged)} (re-export them: aot export task ...; <index>: aot export repair)"
            if damaged else ""))
    return 1 if damaged else 0


def run_export_repair(args) -> int:
    from aot.exporter.version_check import loads_as_served
    from aot.serving.store.repair import repair_store

    found = repair_store(_store(args.repo), loads_as_served, dry_run=args.dry_run)
    if not found.damaged:
        report(found.summary(), f"the index of {args.repo} reads whole ({found.tasks} task(s)): nothing to repair")
        return 0
    what = (f"{len(found.damaged_shards)} damaged shard(s), {len(found.damaged_logs)} damaged log(s), "
            f"{len(found.damaged_indexes)} damaged index(es); {len(found.recovered)} task(s) recovered from their "
            f"folders" + (f", {len(found.unrecoverable)} folder(s) that cannot serve: "
                          f"{', '.join(sorted(found.unrecoverable))}" if found.unrecoverable else ""))
    if args.dry_run:
        report(found.summary(), f"would repair {args.repo}: {what} (run it without --dry-run)",
               *(f"would discard: {words}" for words in found.discarded))
        return 1  # the store does not read whole: as `aot export verify` says of it
    report(found.summary(), f"repaired {args.repo}: {what}; index {found.generation} holds {found.tasks} task(s); "
                            "servers read it from their next refresh",
           *(f"discarded: {words}" for words in found.discarded))
    return 0


def _store(repo: str):
    from aot.serving.repository import read_repository
    from aot.serving.store.writer import TaskStore

    return TaskStore.of(read_repository(repo))


def run_export_tenant(args) -> int:
    from aot.serving.store.tenant_admin import create_tenants, delete_tenant, list_tenants, rotate_tenant

    store = _store(args.repo)
    if args.action == "list":
        if args.tenants:
            raise ValueError("aot export tenant list takes no TENANT")
        tenants = list_tenants(store)
        report(tenants, f"{len(tenants)} tenant(s) in {args.repo}")
        return 0
    if not args.tenants:
        raise ValueError(f"aot export tenant {args.action}: give at least one TENANT")
    if args.action == "create":
        made = create_tenants(store, args.tenants)
        report([{"tenant": done.tenant, "key": done.key} for done in made],
               f"created {len(made)} tenant(s) in {args.repo}: each key is shown once (the store keeps its sha256 "
               "only)",
               f"next: aot export task --task DIR --repo {args.repo} --name {made[0].tenant}/NAME, then "
               f"AOT_TENANT_KEY=<key> aot infer --task {made[0].tenant}/NAME \"some text\"")
        return 0
    for tenant in args.tenants:  # rotate and delete: one change each, reported as it is made
        if args.action == "delete":
            done = delete_tenant(store, tenant)
            report({"tenant": done.tenant, "key": None, "deleted": True, "removed_tasks": done.removed_tasks},
                   f"deleted tenant {done.tenant} and its {len(done.removed_tasks)} task(s) from {args.repo}: servers "
                   "stop answering them from their next batch, and their versions are gone at once (none is kept for "
                   "pinned requests)")
        else:
            done = rotate_tenant(store, tenant)
            report({"tenant": done.tenant, "key": done.key},
                   f"rotated the key of tenant {done.tenant} in {args.repo}: this key is shown once (the store keeps "
                   "its sha256 only); the old key stops working from the servers' next batch")
    return 0


def run_export_versions(args) -> int:
    from aot.serving.store.version_admin import list_versions

    versions = list_versions(_store(args.repo), args.name)
    report(versions, f"{len(versions)} version(s) of {args.name} in {args.repo}")
    return 0


def run_export_rollback(args) -> int:
    from aot.serving.store.version_admin import rollback

    notes: list[str] = []
    replaced = rollback(_store(args.repo), args.name, args.version, args.allow_label_change, notes)
    report({"name": args.name, "current": args.version, "replaced": replaced},
           f"{args.name} answers {args.version} from the servers' next batch; {replaced} is kept (aot export "
           f"rollback {args.name} {replaced} --repo {args.repo} undoes this)", *(f"warning: {n}" for n in notes))
    return 0


def run_export_route(args) -> int:
    from aot.serving.store.version_admin import parse_weights, route

    notes: list[str] = []
    chosen = route(_store(args.repo), args.name, parse_weights(args.weights), args.allow_label_change, notes)
    total = sum((chosen or {}).values())
    report({"name": args.name, "route": None if chosen is None else {v: w / total for v, w in chosen.items()}},
           f"{args.name}: " + ("route cleared, the current version answers every request" if chosen is None else
                               "requests split " + ", ".join(f"{v} {100 * w / total:.4g}%" for v, w in chosen.items()))
           + " from the servers' next batch", *(f"warning: {n}" for n in notes))
    return 0
