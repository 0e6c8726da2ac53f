"""`python -m aot` runs the `aot` command."""

import sys

from aot.cli import main

sys.exit(main())
