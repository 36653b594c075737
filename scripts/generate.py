#!/usr/bin/env python3
"""Continue prompts with an exported SavedModel:

    python scripts/generate.py --model saved_models/tfpar_lm --prompt "the cat" --seed 1

The command lives in ``tfpar.tools.generate`` (installed as ``tfpar-generate``);
this file runs it from a clone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.commands import COMMANDS, run, start  # noqa: E402  (no TensorFlow)

MODULE = COMMANDS["tfpar-generate"]


def main(argv=None) -> int:
    return run(MODULE, argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(start(MODULE))
