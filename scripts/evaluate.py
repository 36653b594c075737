#!/usr/bin/env python3
"""Perplexity of a corpus split, from a SavedModel or a training run's model dir:

    python scripts/evaluate.py --model saved_models/tfpar_lm --data ptb --split test
    python scripts/evaluate.py --model-dir runs/mirrored-... --strategy mirrored --json

The command lives in ``tfpar.tools.evaluate`` (installed as ``tfpar-evaluate``);
this file runs it from a clone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.commands import COMMANDS, run, start  # noqa: E402  (no TensorFlow)

MODULE = COMMANDS["tfpar-evaluate"]


def main(argv=None) -> int:
    return run(MODULE, argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(start(MODULE))
