#!/usr/bin/env python3
"""Measure training throughput against plain Keras, input stalls, padding and the cost of
distribution, side by side on this host:

    python scripts/benchmark.py --quick --json bench.json --plot bench.png

The command lives in ``tfpar.tools.bench.cli`` (installed as ``tfpar-benchmark``);
this file runs it from a clone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.commands import COMMANDS, run, start  # noqa: E402  (no TensorFlow)

MODULE = COMMANDS["tfpar-benchmark"]


def main(argv=None) -> int:
    return run(MODULE, argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(start(MODULE))
