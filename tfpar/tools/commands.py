"""The commands (``[project.scripts]`` in pyproject.toml) and how each one starts.

Every command is a module with ``main(argv=None, prog=None) -> int`` (``prog``: the name
its usage line shows). There are three ways to start one, and each goes through
:func:`start`::

    tfpar-train --strategy mirrored              # installed: pip install tfpar
    python scripts/train.py --strategy mirrored  # a clone: scripts/*.py
    python -m tfpar.tools.train ...              # what tfpar-launch starts for every task

:func:`start` installs the console filter (:func:`tfpar.tools.console.quiet_native_logs`)
before the command's module, and so TensorFlow, is imported, and names the command in its
usage line as it was started: ``usage: tfpar-train ...`` or ``usage: train.py ...``.
Nothing here imports TensorFlow.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Sequence

# Installed name -> the module whose main() it runs.
COMMANDS = {
    "tfpar-train": "tfpar.tools.train",
    "tfpar-generate": "tfpar.tools.generate",
    "tfpar-evaluate": "tfpar.tools.evaluate",
    "tfpar-download": "tfpar.tools.download",
    "tfpar-launch": "tfpar.tools.launch",
    "tfpar-verify": "tfpar.tools.verify",
    "tfpar-benchmark": "tfpar.tools.bench.cli",
    "tfpar-plot": "tfpar.tools.plot",
}


def run(module: str, argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs command ``module``'s main in this process (no console filter: for tests and
    for scripts' ``main(argv)``); returns its exit status."""
    return importlib.import_module(module).main(argv, prog=prog)


def start(module: str) -> int:
    """Runs command ``module`` as this process's program: console filter first, then the
    module is imported, then its main runs on ``sys.argv``, its usage line naming
    ``sys.argv[0]``'s file name; returns the exit status."""
    from tfpar.tools.console import quiet_native_logs

    quiet_native_logs()  # before TensorFlow is imported
    return run(module, prog=os.path.basename(sys.argv[0]))


# The console-script entry points (pyproject.toml): ``sys.exit(train())``.
def train() -> int:
    return start(COMMANDS["tfpar-train"])


def generate() -> int:
    return start(COMMANDS["tfpar-generate"])


def evaluate() -> int:
    return start(COMMANDS["tfpar-evaluate"])


def download() -> int:
    return start(COMMANDS["tfpar-download"])


def launch() -> int:
    return start(COMMANDS["tfpar-launch"])


def verify() -> int:
    return start(COMMANDS["tfpar-verify"])


def benchmark() -> int:
    return start(COMMANDS["tfpar-benchmark"])


def plot() -> int:
    return start(COMMANDS["tfpar-plot"])
