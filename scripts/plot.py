#!/usr/bin/env python3
"""Learning curves of training runs, from their model dirs' metrics.jsonl:

    python scripts/plot.py runs/ptb-small --out curve.png

The command lives in ``tfpar.tools.plot`` (installed as ``tfpar-plot``);
this file runs it from a clone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.commands import COMMANDS, run, start  # noqa: E402  (no TensorFlow)

MODULE = COMMANDS["tfpar-plot"]


def main(argv=None) -> int:
    return run(MODULE, argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(start(MODULE))
