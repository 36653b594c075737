"""A training run's model dir as the commands read it back: its config, vocabulary and
the checkpoint of the weights asked for (``--weights latest | best``).

A model dir holds ``config.json``, ``vocab.txt``, ``checkpoints/`` (the latest states)
and, once an epoch has ended, ``best/`` (the state of the epoch with the best valid
perplexity; :class:`tfpar.training.checkpoints.Checkpointer`). ``tfpar-evaluate`` and
``tfpar-generate`` rebuild the model from the config and restore the weights, as
training saved them, by name (:func:`tfpar.training.state.named_weights`).
"""

from __future__ import annotations

import argparse
import os

from tfpar.config import Config
from tfpar.errors import CheckpointError, ConfigError

# --weights: the folder of the model dir each choice reads its checkpoint from.
WEIGHTS = {"latest": "checkpoints", "best": "best"}


def add_weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="latest", choices=tuple(WEIGHTS),
                   help="--model-dir: latest (the run's last checkpoint, in checkpoints/) | "
                        "best (the epoch with the best valid perplexity, kept in best/) "
                        "(default: %(default)s)")


def check_weights(args: argparse.Namespace) -> None:
    """ConfigError for ``--weights best`` with ``--model``: a SavedModel holds one set."""
    if args.model and args.weights != "latest":
        raise ConfigError(f"--weights {args.weights} applies to --model-dir only; a SavedModel "
                          "(--model) holds the weights it was exported with")


def stored_run(model_dir: str) -> tuple[Config, str]:
    """The run's config and the path of its vocabulary.

    Raises:
      CheckpointError: ``model_dir`` is no training run's model dir.
    """
    import tensorflow as tf

    from tfpar import files
    from tfpar.training.checkpoints import CONFIG_FILE

    path = os.path.join(model_dir, CONFIG_FILE)
    vocab = os.path.join(model_dir, "vocab.txt")
    files.check_file_system(model_dir, "--model-dir")
    if not tf.io.gfile.isdir(model_dir):
        raise CheckpointError(f"--model-dir {model_dir!r} does not exist; give a training "
                              "run's model dir")
    for needed in (path, vocab):
        if not tf.io.gfile.exists(needed) or tf.io.gfile.isdir(needed):
            raise CheckpointError(f"--model-dir {model_dir!r} has no {os.path.basename(needed)};"
                                  " give the model dir of a tfpar training run")
    return Config.from_json(files.read_text(path)), vocab


def checkpoint_path(model_dir: str, weights: str) -> str:
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
        raise CheckpointError(f"--model-dir {model_dir!r} has no checkpoint in best/ (kept "
                              "at the first epoch end); use --weights latest, or train a "
                              "whole epoch")
    raise CheckpointError(f"--model-dir {model_dir!r} has no checkpoint in {folder}/; "
                          "train it first")


def restore_weights(layers: dict, path: str) -> None:
    """:func:`tfpar.training.checkpoints.restore_weights` (imported when called: the CLI
    reads this module before TensorFlow starts)."""
    from tfpar.training import checkpoints

    checkpoints.restore_weights(layers, path)


def restored_model(model_dir: str, weights: str):
    """The run's model outside any strategy, built as the export builds it, with the
    ``weights`` restored; returns ``(model, vocab, checkpoint path)``.

    Raises:
      CheckpointError: not a run, no such checkpoint, or one that does not fit.
    """
    from tfpar.data.vocab import Vocab
    from tfpar.model.lm import build_model
    from tfpar.training.state import named_weights

    config, vocab_path = stored_run(model_dir)
    path = checkpoint_path(model_dir, weights)
    vocab = Vocab.load(vocab_path, tokenizer=config.data.tokenizer)
    model = build_model(config.model, len(vocab), seed=config.train.seed)
    restore_weights(named_weights(model), path)
    return model, vocab, path
