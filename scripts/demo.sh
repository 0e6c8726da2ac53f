#!/usr/bin/env bash
# The main job, end to end on the packaged real model (CPU): train an AoT P-Tuning task on MiniLM and Rotten
# Tomatoes, export the backbone and the task into a Triton model repository, serve it with a local tritonserver,
# and call it over gRPC with its task id (answers are compared with `aot predict`).
#
# Environment: AOT_DEMO_DIR (default runs/demo), AOT_DEMO_SAMPLES (train subset, default: all 10,200 reviews),
# AOT_GRPC_PORT / AOT_HTTP_PORT / AOT_METRICS_PORT / AOT_HEALTH_PORT (default 8001 / 8000 / 8002 / 8003).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
AOT=.venv/bin/aot
OUT=${AOT_DEMO_DIR:-runs/demo}
SAMPLES=${AOT_DEMO_SAMPLES:-}
mkdir -p "$OUT"
start=$SECONDS
# Each step says how long the demo has run, so that the README's figure (about 3-4 minutes on 2 cores, most of it
# training, whose progress bar shows the time left) can be checked as it goes.
stage() { echo "== $1 [$((SECONDS - start)) s so far]"; }
weak="quick demo (AOT_DEMO_SAMPLES=$SAMPLES): its task trains on $SAMPLES reviews only, so its model is weak, near \
chance: it may well call the negative example positive; the full demo trains on all 10,200 (dev accuracy about 0.79)"
[ -z "$SAMPLES" ] || echo "== $weak"

stage "1/4 train: FC AoT P-Tuning on MiniLM, Rotten Tomatoes (our split), 1 epoch, 64 tokens"
"$AOT" train --model minilm --data rotten_tomatoes --method fc --out "$OUT/task" --overwrite --epochs 1 \
  --max-length 64 --eval-every 160 ${SAMPLES:+--max-train-samples "$SAMPLES"}

stage "2/4 export: the shared backbone (once), then the task"
"$AOT" export backbone --model minilm --repo "$OUT/repo" --overwrite
"$AOT" export task --task "$OUT/task" --repo "$OUT/repo" --name sentiment

stage "3/4 serve: local tritonserver on CPU"
"$AOT" serve --repo "$OUT/repo" --grpc-port "${AOT_GRPC_PORT:-8001}" --http-port "${AOT_HTTP_PORT:-8000}" \
  --metrics-port "${AOT_METRICS_PORT:-8002}" --health-port "${AOT_HEALTH_PORT:-8003}" > "$OUT/serve.json" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  [ -s "$OUT/serve.json" ] && break
  kill -0 $server 2>/dev/null || { echo "server failed to start" >&2; exit 1; }
  sleep 0.5
done
url=$(.venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))['grpc'])" "$OUT/serve.json")

stage "4/4 infer over gRPC with task id 'sentiment' (then the same texts in PyTorch)"
texts=("A warm, funny and beautifully acted film." "A tedious, joyless slog that never finds its footing.")
"$AOT" infer --url "$url" --task sentiment "${texts[@]}" | tee "$OUT/served.jsonl"
"$AOT" predict --task "$OUT/task" "${texts[@]}" > "$OUT/predicted.jsonl"
.venv/bin/python - "$OUT/served.jsonl" "$OUT/predicted.jsonl" <<'PY'
import json, sys
served, predicted = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
diff = max(abs(a - b) for s, p in zip(served, predicted) for a, b in zip(s["logits"], p["logits"]))
assert [s["label"] for s in served] == [p["label"] for p in predicted], (served, predicted)
print(f"served == aot predict: labels equal, max |logit difference| {diff:.2e}")
assert diff <= 1e-3
PY
dev=$(.venv/bin/python -c "import json,sys; m=json.load(open(sys.argv[1])); print(f\"{m['metric']} {m['dev']:.3f}\")" \
  "$OUT/task/metrics.json")
echo "== done in $((SECONDS - start)) s (the README says about 3-4 minutes on 2 cores for the full demo); the task's \
dev $dev; the repository $OUT/repo holds $(du -sh "$OUT/repo" | cut -f1) (the encoder's graphs and the task's fused \
table: docs/serving.md, the task pool)"
[ -z "$SAMPLES" ] || echo "== $weak"
