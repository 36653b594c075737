"""Checkpoints: ``tf.train.Checkpoint`` + ``CheckpointManager``, config beside them.

``model_dir`` holds ``config.json`` (the run's configuration), ``vocab.txt``,
``checkpoints/`` and the TensorBoard event folders. The latest checkpoint is the one the
manager's state file names (never the newest file by time). A re-run with the same
model dir restores it; one whose configuration changes the model is refused.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import tempfile

import tensorflow as tf

from tfpar.config import Config, resume_conflicts
from tfpar.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)
CONFIG_FILE = "config.json"


def incompatible(model_dir: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot resume {model_dir}: {what}; use a new --model-dir or the original settings"
    )


def prepare_model_dir(config: Config, is_chief: bool) -> str:
    """Creates the model dir (default ``runs/<strategy>-<timestamp>``) and checks or writes
    its ``config.json``."""
    model_dir = config.run.model_dir or os.path.join(
        "runs", f"{config.dist.strategy}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    )
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise ConfigError(f"--model-dir {model_dir!r} is a file; give a folder (new or a "
                          "previous run's to resume it)")
    try:
        os.makedirs(model_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create --model-dir {model_dir!r}: {e.strerror}") from None
    path = os.path.join(model_dir, CONFIG_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            stored = Config.from_json(f.read())
        conflicts = resume_conflicts(stored, config)
        if conflicts:
            raise incompatible(model_dir, conflicts[0])
    elif is_chief:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(config.to_json())
        os.replace(tmp, path)
    return model_dir


class Checkpointer:
    """Saves and restores the training state; only the chief writes."""

    def __init__(self, model_dir: str, is_chief: bool, keep: int, **trackables):
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.directory = os.path.join(model_dir, "checkpoints")
        self.is_chief = is_chief
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, keep)
        self._last_saved = -1

    def restore_latest(self) -> int | None:
        """Restores the newest readable checkpoint; returns its step (None: fresh start).

        A damaged newest checkpoint (truncated or corrupt files) is reported and the one
        before it is used, so a crash while a checkpoint was written loses one interval
        at most.
        """
        for path in reversed(self.manager.checkpoints):
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
            except (tf.errors.OpError, ValueError, AssertionError, IndexError, OSError) as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                log.warning("checkpoint %s is unreadable (%s); trying the previous one",
                            path, reason[:200])
                continue
            step = int(path.rsplit("-", 1)[-1])
            self._last_saved = step
            log.info("resumed from %s (step %d)", path, step)
            return step
        if self.manager.checkpoints:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} (tried "
                f"{len(self.manager.checkpoints)}); remove the folder to start afresh")
        return None

    def save(self, step: int) -> None:
        """Saves the state at ``step`` unless that step is saved already.

        Under MultiWorkerMirroredStrategy saving is a collective every worker must join,
        so a worker that is not the chief saves too, into a temporary folder it deletes.
        """
        if step == self._last_saved:
            return
        if self.is_chief:
            try:
                self.manager.save(checkpoint_number=step)
            except (OSError, tf.errors.OpError) as e:
                # TF writes a checkpoint under temporary names and renames it last, so a
                # failed write leaves the previous checkpoint as the latest one.
                reason = getattr(e, "strerror", None) or getattr(e, "message", None) or str(e)
                raise CheckpointError(
                    f"cannot write the checkpoint of step {step} to {self.directory}: "
                    f"{reason.strip().splitlines()[0]}; free space or give another "
                    "--model-dir, then run again to resume from the last checkpoint") from None
        else:
            scratch = tempfile.mkdtemp(prefix="tfpar-worker-checkpoint-")
            try:
                tf.train.CheckpointManager(self.checkpoint, scratch, 1).save(checkpoint_number=step)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        self._last_saved = step
