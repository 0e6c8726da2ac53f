#!/usr/bin/env bash
# The GPU serving check (issues 12, 45 and 52), on a machine with a CUDA GPU, Python with PyTorch (CUDA), transformers,
# tokenizers, safetensors, peft, scikit-learn, psutil, matplotlib and grpcio, and no network: .gpu-kit/
# (scripts/gpu-kit.sh, run where the package index is reachable) brings the rest. Served on the local tritonserver
# with the torch engine, random-weight encoders of MiniLM's shape (and for perf a base-size one: speed and parity need
# no trained weights; no accuracy is measured).
#
#   bash scripts/gpu-check.sh [STAGE...]   default: perf, one call of the device tool (8 minutes); the others two
#                                          to a call (10 minutes at most)
#     perf      issue 52's check, for MiniLM's shape and a base-size encoder (RoBERTa-base's compute shape with
#               MiniLM's tokenizer): the engine alone at the served max batch (128 x 64 tokens, CUDA graphs); served
#               (aot serve --device cuda --vanilla, the step in AOT_GPU_INSTANCES instances) under perf_analyzer:
#               vanilla, AoT 1 task, AoT 8 mixed tasks at concurrency 1, 32, 256 with 1-text and 64-text requests
#               (a window of long requests, 64 texts at c=256, measured over a longer interval); the GPU's
#               utilisation through each window; py-spy of one step instance through AoT 8 mixed, 64-text requests,
#               c=256 on MiniLM's shape; batches run eagerly (any fails the check), /ready's warnings, parity with
#               `aot predict`; the targets evaluated (aot bench gpu-perf: perf.json, perf.md, minilm/py-spy.txt). It
#               is planned to end within AOT_GPU_SECONDS (450) of the start: windows that would not fit are skipped,
#               the base-size shape's least important first, and named (a window slower than the ones before it can
#               overrun by its excess)
#     smoke     served answers vs `aot predict`; vanilla vs AoT (1 and 8 mixed tasks) at concurrency 1 and 8, 200
#               requests each (the path works at all)
#     serve     throughput and p50/p99 at concurrency 1, 8, 32: vanilla vs AoT with 1 and 8 mixed tasks, fused and
#               factored, on a pool that holds the 8 tables (the default 1 GiB holds 7); start-up and memory
#     pool      8 mixed fused tasks served from a pool of 4 tables (more tasks than fit resident)
#     overhead  the backbone alone, AoT vs vanilla, CUDA graphs, sequence 128 and 384, batch 1, 16, 64
#
# Results: $OUT/<stage>/ (the device tool's folder; else runs/gpu-check), written as they are measured: perf.json,
# perf.md; serve.json, serve.md, serve.png (overhead.*), and $OUT/gpu-check.log. Environment: PYTHON (default
# python3), AOT_GPU_DEVICE (cuda; cpu rehearses the stages on a machine without one: perf with a stand-in load
# generator, labelled, where perf_analyzer cannot run), AOT_GPU_KIT (.gpu-kit), AOT_GPU_WORK (/tmp/aot-gpu),
# AOT_GPU_SECONDS (450: the perf stage's budget), AOT_GPU_REQUESTS (2000 per serve and pool measurement),
# AOT_GPU_ROUNDS (1: aot bench serve --rounds), AOT_GPU_INSTANCES (4: the perf stage's served step instances on the
# GPU).
set -euo pipefail
deadline=$(( $(date +%s) + ${AOT_GPU_SECONDS:-450} ))  # the perf stage ends by then, set-up included
cd "$(dirname "$0")/.."
root=$PWD
kit=${AOT_GPU_KIT:-$root/.gpu-kit}
py=${PYTHON:-python3}
device=${AOT_GPU_DEVICE:-cuda}
work=${AOT_GPU_WORK:-/tmp/aot-gpu}
requests=${AOT_GPU_REQUESTS:-2000}
out=${OUT:-$root/runs/gpu-check}
case ${1:-} in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;; esac  # the comment above
[ $# -gt 0 ] || set -- perf
for stage in "$@"; do
  case $stage in perf|smoke|serve|pool|overhead) ;;
    *) echo "gpu-check: unknown stage '$stage': expected perf, smoke, serve, pool or overhead" >&2; exit 2 ;;
  esac
done
[ -d "$kit" ] || { echo "gpu-check: no $kit: run bash scripts/gpu-kit.sh where the package index is reachable" >&2; exit 2; }
for tool in perf-analyzer py-spy; do  # the perf stage's load generator and profiler (a rehearsal does without)
  if [[ " $* " == *" perf "* ]] && [ "$device" != cpu ] && ! compgen -G "$kit/$tool/*.whl" >/dev/null; then
    echo "gpu-check: $kit has no $tool/ wheel (the perf stage needs it): rebuild it with bash scripts/gpu-kit.sh" >&2
    exit 2
  fi
done
mkdir -p "$out" "$work"
exec > >(tee -a "$out/gpu-check.log") 2>&1
tee_pid=$!
trap 'exec >&- 2>&-; wait "$tee_pid" 2>/dev/null || true' EXIT  # the log is whole before $OUT is collected

# --- the environment (again on every call: a lent machine starts bare) -----------------------------------------
kit_python=$(cat "$kit/python-version")
have=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
[ "$have" = "$kit_python" ] || { echo "gpu-check: $py is Python $have, the kit is for $kit_python" >&2; exit 2; }
# what the environments below were made from: a rebuilt kit, another Python or another checkout makes them again
stamp=$(cd "$kit" && { ls -l --time-style=full-iso python-version tritonserver.tar.xz wheels step-wheels; echo "$py $root"; } | cksum)
# aot itself runs this Python (its numpy may be 2), with the client wheels and tritonserver first on its path
if [ "$(cat "$work/client/.done" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$work/client"
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$work/client" "$kit"/wheels/*.whl
  tar -xJf "$kit/tritonserver.tar.xz" -C "$work/client"
  echo "$stamp" > "$work/client/.done"
fi
# the python steps run an environment of their own: numpy<2 first, then this project (a .pth: the stub may not read
# PYTHONPATH), then every site-packages folder of this Python (its venv's, the system's, the user's)
if [ "$(cat "$work/step/.done" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$work/step"
  "$py" -m venv --without-pip "$work/step"
  step_site=$("$work/step/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$step_site" "$kit"/step-wheels/*.whl
  echo "$root" > "$step_site/aot-project.pth"
  # the machine's scipy (and sklearn, through it) needs numpy>=2: under numpy 1.26 `import transformers.modeling_utils`
  # fails (np.long). No step uses them, and transformers skips a package that find_spec does not find (None in
  # sys.modules)
  echo 'import sys; sys.modules.update(dict.fromkeys(("scipy", "sklearn")))' > "$step_site/aot-hide-numpy2-only.pth"
  "$py" - "$step_site/zz-base-packages.pth" <<'PY'
import sys
folders = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
# one line, no comprehension: site.py exec()s it in a scope that a nested one would not see
open(sys.argv[1], "w").write(f"import site; list(map(site.addsitedir, {folders!r}))\n")
PY
  echo "$stamp" > "$work/step/.done"
fi
export PYTHONPATH="$work/client:$kit/data:$root${PYTHONPATH:+:$PYTHONPATH}"
export AOT_STEP_PYTHON=$work/step/bin/python3 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# this checkout is on PYTHONPATH, not installed: no entry points, so `aot bench` comes registered in code
aot() { "$py" -m aot.benchmarks "$@"; }

echo "== gpu-check $(date -u +%FT%TZ): device $device, stages: $*"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c 'import numpy, torch, transformers; print(f"aot python: torch {torch.__version__} (cuda {torch.version.cuda}, available {torch.cuda.is_available()}), transformers {transformers.__version__}, numpy {numpy.__version__}")'
"$AOT_STEP_PYTHON" -c 'import numpy, torch, aot.serving; from transformers import AutoModel; print(f"step python: numpy {numpy.__version__}, torch {torch.__version__}, transformers imports")'
stub=$(ls "$work"/client/pytriton/tritonserver/python_backend_stubs/*/triton_python_backend_stub)
libdir=$("$AOT_STEP_PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
LD_LIBRARY_PATH=$libdir ldd "$stub" | grep -E 'libpython|libcudart|not found' || true

echo "== set-up: $SECONDS s"

# --- what the stages serve: random encoders (MiniLM's config and tokenizer, random weights)
random_encoder() {  # DEST SHAPE: source (MiniLM's own), or base (aot.benchmarks.encoders)
  "$py" -m aot.benchmarks.encoders "$kit/minilm" "$1" "$2"
}
model=$work/minilm-random
task=$work/task
for stage in "$@"; do
  [ "$stage" = perf ] && continue  # the other stages serve a task of MiniLM's shape, trained once
  random_encoder "$model" source
  if [ ! -f "$task/config.json" ]; then
    echo "== train: FC on the random encoder, Rotten Tomatoes, 2,000 reviews, 1 epoch, 128 tokens"
    aot train --model "$model" --data rotten_tomatoes --method fc --out "$task" --epochs 1 --max-length 128 \
      --max-train-samples 2000 --device "$device" --no-progress
  fi
  table_bytes=$("$py" -c 'import json, sys; c = json.load(open(sys.argv[1])); print(c["vocab_size"] * c["num_hidden_layers"] * c["hidden_size"] * 2)' "$model/config.json")
  break
done
perf_stage() {  # issue 52's check (the comment above); its exit status is the check's
  local start=$SECONDS load=() shape tool dir tool_stamp
  for tool in perf-analyzer py-spy; do  # each wheel into a folder of its own, again when the kit changed
    compgen -G "$kit/$tool/*.whl" >/dev/null || continue
    dir=$work/$tool
    tool_stamp=$(ls -l --time-style=full-iso "$kit/$tool" | cksum)
    if [ "$(cat "$dir/.done" 2>/dev/null)" != "$tool_stamp" ]; then
      rm -rf "$dir"
      "$py" -m pip install -q --no-index --no-deps --no-compile --target "$dir" "$kit/$tool"/*.whl
      echo "$tool_stamp" > "$dir/.done"
    fi
  done
  [ ! -f "$work/py-spy/bin/py-spy" ] || { chmod +x "$work/py-spy/bin/py-spy"; load+=(--py-spy "$work/py-spy/bin/py-spy"); }
  if [ "$device" = cpu ]; then  # the rehearsal: perf_analyzer does not run on an older glibc; tiny loads
    load+=(--stand-in-requests 4 --engine-batch 4 --engine-repeats 2)
  else
    chmod +x "$work/perf-analyzer/perf_analyzer/bin/perf_analyzer"
    load+=(--perf-analyzer "$work/perf-analyzer/perf_analyzer/bin/perf_analyzer")
  fi
  random_encoder "$work/perf-minilm" source
  random_encoder "$work/perf-base" base
  echo "== perf: random encoders: $((SECONDS - start)) s"
  for shape in minilm base; do  # accuracy does not matter: a task to serve (4 optimizer steps)
    [ -f "$work/perf-task-$shape/config.json" ] || aot train --model "$work/perf-$shape" --data rotten_tomatoes \
      --method fc --out "$work/perf-task-$shape" --epochs 1 --max-length 64 --max-train-samples 64 \
      --device "$device" --no-progress >/dev/null
    echo "== perf: task on $shape trained: $((SECONDS - start)) s"
  done
  local status=0
  aot bench gpu-perf --shape "minilm=$work/perf-task-minilm" --shape "base=$work/perf-task-base" \
    --device "$device" --deadline "$deadline" --out "$out/perf" --work "$work/perf" "${load[@]}" \
    --gpu-instances "${AOT_GPU_INSTANCES:-4}" \
    --note "base: a BERT config of RoBERTa-base's compute shape (12 layers, hidden 768, 12 heads, FFN 3072) with \
MiniLM's tokenizer and vocabulary (30,522, not RoBERTa's 50,265): the kit carries no RoBERTa tokenizer" \
    --note "every encoder has random weights; each task is FC trained 1 epoch on 64 reviews (accuracy not measured)" \
    || status=$?
  echo "== perf: $((SECONDS - start)) s, exit $status; the whole call so far: $SECONDS s (results: $out/perf/perf.md)"
  [ "$status" = 0 ] || echo "gpu-check: the perf stage FAILED (perf.md says why)" >&2
  return "$status"
}
serve_bench() {  # NAME ARGS...: aot bench serve into $out/NAME
  local name=$1; shift
  local start=$SECONDS
  # one round: smoke and serve share a 10-minute device call (370 s for serve on the H100 with single passes)
  aot bench serve --task "$task" --engine torch --device "$device" --out "$out/$name" --no-progress \
    --rounds "${AOT_GPU_ROUNDS:-1}" "$@"
  echo "== $name: $((SECONDS - start)) s"
}

for stage in "$@"; do
  case $stage in
    perf)
      perf_stage ;;
    smoke)
      serve_bench smoke --tasks 1 --concurrency 1,8 --storage fused --requests 200 ;;
    serve)
      serve_bench serve --tasks 1,8 --concurrency 1,8,32 --storage fused,factored --requests "$requests" \
        --pool-bytes $((8 * table_bytes + (1 << 20))) ;;
    pool)
      serve_bench pool --tasks 8 --concurrency 8,32 --storage fused --requests "$requests" \
        --pool-bytes $((4 * table_bytes)) ;;
    overhead)
      start=$SECONDS
      graphs=$([ "$device" = cpu ] || echo --cuda-graphs)
      aot bench overhead --models "$model,roberta-base" --device "$device" $graphs --seq 128,384 --batch 1,16,64 \
        --methods aot-fused --out "$out/overhead" --no-progress
      echo "== overhead: $((SECONDS - start)) s" ;;
  esac
done
