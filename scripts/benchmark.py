#!/usr/bin/env python3
"""Measure training throughput against plain Keras, input stalls, padding and the cost of
distribution, side by side on this host:

    python scripts/benchmark.py --quick --json bench.json --plot bench.png

Prints one PASS/FAIL line per target and exits 0 (1 when a contender failed, named on
stderr, or with ``--check`` when a target is missed; 2 on a usage error). The logic lives
in the package ``tfpar.tools.bench`` (``python -m tfpar.tools.bench`` runs it too);
``--help`` lists every flag.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    # Quiet TensorFlow's C++ start-up chatter; it reads this once, when it is imported.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfpar.tools.bench.cli import main as benchmark_main

    return benchmark_main(argv)


if __name__ == "__main__":
    from tfpar.tools.console import quiet_native_logs  # noqa: E402

    quiet_native_logs()  # before TensorFlow is imported
    sys.exit(main())
