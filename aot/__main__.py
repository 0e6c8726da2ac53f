"""`python -m aot` runs the `aot` command."""

import sys

from aot.cli.main import main

sys.exit(main())
