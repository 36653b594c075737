"""Errors a user can cause, each with a one-line message.

Library code raises these; the command-line scripts catch ``TfparError`` and print
``error: <message>`` on one line to stderr, exit with status 2, and show no traceback.
Every message names the bad value and what would be right.
"""


class TfparError(Exception):
    """Base class of every user-facing error in tfpar."""

    #: The command-line exit status for this error.
    exit_code = 2


class ConfigError(TfparError, ValueError):
    """A flag or configuration field has a value that cannot work."""


class DataError(TfparError, ValueError):
    """A corpus, split or vocabulary is missing, empty or malformed."""


class DeviceError(TfparError, ValueError):
    """A requested device or device count does not exist on this host."""


class ClusterError(TfparError, ValueError):
    """TF_CONFIG or the cluster it describes is malformed or unusable."""


class CheckpointError(TfparError):
    """A checkpoint or export cannot be written, read or resumed from."""


class TrainingError(TfparError):
    """Training cannot go on (e.g. a non-finite loss with --on-nan stop)."""


class Interrupted(TfparError):
    """SIGINT or SIGTERM stopped training after a step; a checkpoint was written."""

    exit_code = 130


class Preempted(Interrupted):
    """SIGTERM or SIGINT reached a worker of a multi-worker job: every worker stopped
    after the same step and the job's checkpoint of that step was written.

    Every worker exits with status 75 (``EX_TEMPFAIL`` of sysexits.h, "try again
    later"): the job was not done and lost nothing; the same command run again resumes
    from that step. A scheduler or launcher may relaunch the job on this status.
    """

    exit_code = 75


# The installed commands ([project.scripts] in pyproject.toml) and the script of a clone
# that runs the same code: a message that tells the user to run one names both, so it is
# true after `pip install tfpar` and in a clone run with `python scripts/...`.
SCRIPTS = {"tfpar-train": "train.py", "tfpar-generate": "generate.py",
           "tfpar-evaluate": "evaluate.py", "tfpar-download": "download_data.py",
           "tfpar-launch": "launch_local.py", "tfpar-verify": "verify_parallel.py",
           "tfpar-benchmark": "benchmark.py"}


def command(name: str, args: str = "") -> str:
    """How a message names a command to run: ``command("tfpar-download", "ptb")`` is
    ``tfpar-download ptb (from a clone: python scripts/download_data.py ptb)``."""
    tail = f" {args}" if args else ""
    return f"{name}{tail} (from a clone: python scripts/{SCRIPTS[name]}{tail})"
