"""A training run's model dir read back: its config, vocabulary and the checkpoint of the
weights asked for (``latest`` or ``best``), and those weights restored into a model.

A model dir holds ``config.json``, ``vocab.txt``, ``checkpoints/`` (the latest states)
and, once an epoch has ended, ``best/`` (the state of the epoch with the best valid
perplexity; :class:`tfpar.training.checkpoints.Checkpointer`). ``tfpar-evaluate`` and
``tfpar-generate`` (``--model-dir``) and a fine-tuning run (``--init-from``) read it here.
Messages name the flag that gave the folder (``flag``) and the one that chose the
weights (``weights_flag``).

Nothing here imports TensorFlow at module level: the commands import this module before
they set TensorFlow's log level (``tfpar.tools.cli``).
"""

from __future__ import annotations

import os

from tfpar.config import Config, is_custom_cell
from tfpar.errors import CheckpointError, ConfigError

# The folder of the model dir each choice of weights reads its checkpoint from
# (checkpoints.Checkpointer's directory and best_directory).
WEIGHTS = {"latest": "checkpoints", "best": "best"}


def stored_run(model_dir: str, flag: str = "--model-dir") -> tuple[Config, str]:
    """The run's config and the path of its vocabulary.

    Raises:
      CheckpointError: ``model_dir`` is no training run's model dir.
    """
    import tensorflow as tf

    from tfpar import files
    from tfpar.data.vocab import VOCAB_FILE
    from tfpar.training.checkpoints import CONFIG_FILE

    path = os.path.join(model_dir, CONFIG_FILE)
    vocab = os.path.join(model_dir, VOCAB_FILE)
    files.check_file_system(model_dir, flag)
    if not tf.io.gfile.isdir(model_dir):
        raise CheckpointError(f"{flag} {model_dir!r} does not exist; give a training "
                              "run's model dir")
    for needed in (path, vocab):
        if not tf.io.gfile.exists(needed) or tf.io.gfile.isdir(needed):
            raise CheckpointError(f"{flag} {model_dir!r} has no {os.path.basename(needed)};"
                                  " give the model dir of a tfpar training run")
    return Config.from_json(files.read_text(path)), vocab


def check_cell_named(stored: Config, named: str | None, model_dir: str,
                     flag: str = "--model-dir") -> None:
    """A model dir names code: a run trained with ``--cell MODULE:NAME`` has it in its
    config.json. That code is imported only when the command line names the same cell
    (``named``, its ``--cell``), never on the model dir's word alone.

    Raises:
      ConfigError: the run's cell is a user's and ``named`` is not it, or ``named`` is
        another cell than the run's.
    """
    cell = stored.model.cell
    if named is None:
        if is_custom_cell(cell):
            raise ConfigError(
                f"{flag} {model_dir!r} was trained with --cell {cell}, code that is not "
                f"imported on a model dir's word: add --cell {cell} to import it (its "
                "SavedModel, --model, needs no import)")
        return
    if named != cell:
        raise ConfigError(f"--cell {named} is not the cell of {flag} {model_dir!r}, which "
                          f"was trained with --cell {cell}; give --cell {cell}")


def checkpoint_path(model_dir: str, weights: str, flag: str = "--model-dir",
                    weights_flag: str = "--weights") -> str:
    """The checkpoint (``.../ckpt-N``) of ``weights`` (a :data:`WEIGHTS` key) in the run.

    Raises:
      CheckpointError: the run has no such checkpoint (yet).
    """
    import tensorflow as tf

    folder = WEIGHTS[weights]
    path = tf.train.latest_checkpoint(os.path.join(model_dir, folder))
    if path:
        return path
    if weights == "best":
        raise CheckpointError(f"{flag} {model_dir!r} has no checkpoint in best/ (kept "
                              f"at the first epoch end); use {weights_flag} latest, or train "
                              "a whole epoch")
    raise CheckpointError(f"{flag} {model_dir!r} has no checkpoint in {folder}/; "
                          "train it first")


def checkpoint_step(path: str) -> int:
    """The step of checkpoint ``.../ckpt-N``: N (checkpoints are numbered by step)."""
    return int(path.rsplit("-", 1)[-1])


def restore_weights(layers: dict, path: str) -> None:
    """Restores the model weights ``layers`` (:func:`tfpar.training.state.named_weights`)
    from checkpoint ``path``: the run's moving averages of them where it kept some
    (``--ema-momentum``, the weights it evaluated and exported), else the weights
    themselves; the rest of the optimizer and the counters are left unread.

    Raises:
      CheckpointError: the checkpoint does not hold these weights (another model).
    """
    import tensorflow as tf

    from tfpar.training.state import average_slot

    try:
        tf.train.Checkpoint(layers=layers).restore(path) \
            .expect_partial().assert_existing_objects_matched()
        # The averages, where the run kept them, over the weights just read (matched by
        # the checkpoint's object graph, so any file system the checkpoint is on works).
        tf.train.Checkpoint(moments={average_slot(name): variable
                                     for name, variable in layers.items()}) \
            .restore(path).expect_partial()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"checkpoint {path!r} does not fit the model its config.json "
                              f"describes: {reason}") from None
