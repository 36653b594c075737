"""A training run's model dir as the commands read it back: its config, vocabulary and
the checkpoint of the weights asked for (``--weights latest | best``).

Reading the model dir is :mod:`tfpar.training.stored`'s (a fine-tuning run's
``--init-from`` reads it the same way); this module adds the flags and the model.
``tfpar-evaluate`` and ``tfpar-generate`` rebuild the model from the config and restore the weights, as
training saved them, by name (:func:`tfpar.training.state.named_weights`).
"""

from __future__ import annotations

import argparse

from tfpar.errors import ConfigError
# Read back in the training layer, where a fine-tuning run (--init-from) reads it too.
from tfpar.training.stored import (WEIGHTS, check_cell_named, checkpoint_path,
                                   restore_weights, stored_run)

__all__ = ["WEIGHTS", "add_cell_flag", "add_weights_flag", "check_cell_named",
           "check_weights", "checkpoint_path", "restore_weights", "restored_model",
           "stored_run"]


def add_weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="latest", choices=tuple(WEIGHTS),
                   help="--model-dir: latest (the run's last checkpoint, in checkpoints/) | "
                        "best (the epoch with the best valid perplexity, kept in best/) "
                        "(default: %(default)s)")


def add_cell_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cell", default=None, metavar="MODULE:NAME",
                   help="--model-dir of a run trained with --cell MODULE:NAME: the same "
                        "MODULE:NAME, which lets this command import that code (a model "
                        "dir's config.json alone never makes it import anything; a "
                        "SavedModel, --model, needs no import)")


def check_weights(args: argparse.Namespace) -> None:
    """ConfigError for ``--weights best`` with ``--model``: a SavedModel holds one set."""
    if args.model and getattr(args, "cell", None) is not None:
        raise ConfigError(f"--cell {args.cell} applies to --model-dir only; a SavedModel "
                          "(--model) serves its cell without importing any code")
    if args.model and args.weights != "latest":
        raise ConfigError(f"--weights {args.weights} applies to --model-dir only; a SavedModel "
                          "(--model) holds the weights it was exported with")


def restored_model(model_dir: str, weights: str, cell: str | None = None):
    """The run's model outside any strategy, built as the export builds it, with the
    ``weights`` restored; returns ``(model, vocab, checkpoint path)``. ``cell``: the
    command line's ``--cell`` (:func:`check_cell_named`).

    Raises:
      CheckpointError: not a run, no such checkpoint, or one that does not fit.
      ConfigError: the run's cell is a user's one the command line does not name.
    """
    from tfpar.data.vocab import Vocab
    from tfpar.model.lm import build_model
    from tfpar.training.state import named_weights

    config, vocab_path = stored_run(model_dir)
    check_cell_named(config, cell, model_dir)
    path = checkpoint_path(model_dir, weights)
    vocab = Vocab.load(vocab_path, tokenizer=config.data.tokenizer)
    model = build_model(config.model, len(vocab), seed=config.train.seed)
    restore_weights(named_weights(model), path)
    return model, vocab, path
