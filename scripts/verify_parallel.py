#!/usr/bin/env python3
"""Prove that a parallel set-up computes what one device computes:

    python scripts/verify_parallel.py --strategies default,mirrored:2,tower:2

The command lives in ``tfpar.tools.verify`` (installed as ``tfpar-verify``);
this file runs it from a clone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.commands import COMMANDS, run, start  # noqa: E402  (no TensorFlow)

MODULE = COMMANDS["tfpar-verify"]


def main(argv=None) -> int:
    return run(MODULE, argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(start(MODULE))
