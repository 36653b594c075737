#!/usr/bin/env python3
"""Start a TensorFlow cluster on this machine:

    python scripts/launch_local.py --workers 2 -- --strategy multi_worker --max-steps 300

The command lives in ``tfpar.tools.launch`` (installed as ``tfpar-launch``);
this file runs it from a clone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.commands import COMMANDS, run, start  # noqa: E402  (no TensorFlow)

MODULE = COMMANDS["tfpar-launch"]


def main(argv=None) -> int:
    return run(MODULE, argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(start(MODULE))
