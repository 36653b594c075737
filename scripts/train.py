#!/usr/bin/env python3
"""Train an RNN language model: ``python scripts/train.py --strategy mirrored``.

Thin on purpose: the flags are parsed into a Config and handed to
``tfpar.training.run.train_and_evaluate``; ``--help`` lists every flag.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.tools.cli import train_main  # noqa: E402


def main(argv=None) -> int:
    return train_main(argv)


if __name__ == "__main__":
    from tfpar.tools.console import quiet_native_logs  # noqa: E402

    quiet_native_logs()  # before TensorFlow is imported
    sys.exit(main())
