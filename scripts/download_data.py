#!/usr/bin/env python3
"""Download a known corpus into input/<name>/ and verify it:

    python scripts/download_data.py ptb

The command lives in ``tfpar.tools.download`` (installed as ``tfpar-download``);
this file runs it from a clone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.commands import COMMANDS, run, start  # noqa: E402  (no TensorFlow)

MODULE = COMMANDS["tfpar-download"]


def main(argv=None) -> int:
    return run(MODULE, argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(start(MODULE))
