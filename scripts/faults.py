#!/usr/bin/env python3
"""Inject faults into real training runs and check two promises of tfpar.

    python scripts/faults.py kills --kills 16 --modes sentence,stream
    python scripts/faults.py kills --kills 4 --strategy mirrored --cpu-devices 2 --cpu-hog
    python scripts/faults.py matrix --modes sentence,stream

``kills``: runs killed with SIGKILL at random moments (start-up, tracing, steps, checkpoint
writes, epoch ends, evaluation, export) and run again end bit-identical to an
uninterrupted run; one line per kill with the phase it hit, then a summary line.
``matrix``: a checkpoint written under one strategy / device count resumes under
another; a markdown table of max |Δ| against an uninterrupted default run per mode.
Exit status 0 when everything is exact (or within --tolerance), 1 when not, 2 on a
usage error. The logic lives in ``tests/faults.py`` (the suite's fault injection, not part
of the installed package: it runs this clone's ``scripts/train.py``); ``--help`` on each
subcommand lists its flags.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# Ahead of scripts/ (first on the path when this file runs as a script), whose faults.py
# is this file: `import faults` must find tests/faults.py.
sys.path.insert(0, str(REPO / "tests"))


def main(argv=None) -> int:
    from faults import main as faults_main

    return faults_main(argv)


if __name__ == "__main__":
    from tfpar.tools.console import quiet_native_logs  # noqa: E402

    quiet_native_logs()  # before TensorFlow is imported
    sys.exit(main())
