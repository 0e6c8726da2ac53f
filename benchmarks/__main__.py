"""`python -m benchmarks ARGS`: the `aot` command with this package's `bench` registered in code, for a checkout run
from PYTHONPATH without installing it (no entry points: scripts/gpu-check.sh); `aot` is the same once installed."""

import sys

from aot.cli import REGISTERED, main
from benchmarks.cli import add_bench

REGISTERED["bench"] = add_bench
sys.exit(main())
