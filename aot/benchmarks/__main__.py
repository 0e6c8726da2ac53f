"""`python -m aot.benchmarks ARGS`: the `aot` command with this package's `bench` registered in code, for a checkout run
from PYTHONPATH without installing it (no entry points: scripts/gpu-check.sh); `aot` is the same once installed."""

import sys

from aot.benchmarks.cli import add_bench
from aot.cli.main import REGISTERED, main

REGISTERED["bench"] = add_bench
sys.exit(main())
