"""``python -m tfpar.tools.bench``: the benchmark's command line (also its child process)."""

import sys

from tfpar.tools.bench.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
