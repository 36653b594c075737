"""``tfpar-train``: train an RNN language model, evaluate it and export it.

The flags and their parsing into a Config live in :mod:`tfpar.tools.cli`;
``python -m tfpar.tools.train`` is what every task of a ``tfpar-launch`` job runs.
"""

import sys

from tfpar.tools.cli import train_main as main  # noqa: F401  (the command's main)
from tfpar.tools.cli import train_parser as parser  # noqa: F401

if __name__ == "__main__":
    from tfpar.tools.commands import start

    sys.exit(start("tfpar.tools.train"))
