#!/usr/bin/env python3
"""Train an RNN language model: ``python scripts/train.py --strategy mirrored``; ``--help``
lists every flag.

The command lives in ``tfpar.tools.train`` (installed as ``tfpar-train``);
this file runs it from a clone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.commands import COMMANDS, run, start  # noqa: E402  (no TensorFlow)

MODULE = COMMANDS["tfpar-train"]


def main(argv=None) -> int:
    return run(MODULE, argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(start(MODULE))
