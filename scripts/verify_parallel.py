#!/usr/bin/env python3
"""Prove that a parallel set-up computes what one device computes.

    python scripts/verify_parallel.py --strategies default,mirrored:2,mirrored:4,tower:2,tower:3

trains each strategy for ``--steps`` SGD steps from the same initial weights on the same
global batches, prints max |parameter difference| and the relative difference of the
distributed eval perplexity against ``default``, and exits 1 when one is outside the
tolerances (2 on a usage error). The logic lives in ``tfpar.tools.verify``; ``--help`` lists
every flag.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    # Quiet TensorFlow's C++ start-up chatter; it reads this once, when it is imported.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfpar.tools.verify import main as verify_main

    return verify_main(argv)


if __name__ == "__main__":
    from tfpar.tools.console import quiet_native_logs  # noqa: E402

    quiet_native_logs()  # before TensorFlow is imported
    sys.exit(main())
