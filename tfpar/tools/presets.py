"""Named training configurations: ``train.py --preset NAME``.

A preset is a set of flag values; flags given on the command line override it, and the
resolved configuration is what the run logs and saves in ``config.json``.

The ``ptb-*`` presets are the small, medium and large configurations of TensorFlow's
``ptb_word_lm.py`` (Zaremba et al., 2014: "Recurrent Neural Network Regularization"):
stream (BPTT) mode on PTB, plain SGD with gradient clipping, uniform init and a forget-gate
bias of 0 (``BasicLSTMCell(size, forget_bias=0.0)``: ``--forget-bias 0``), a per-epoch
LR decay after a number of epochs, dropout on the embedding output and on every LSTM
layer's output. tfpar's loss is the per-token mean, while ``ptb_word_lm.py`` sums the
loss over the ``bptt`` steps of a window (and averages over the batch), so its gradient
is ``bptt`` times tfpar's: its ``lr`` 1.0 is ``--lr bptt`` here and its clip norm ``c`` is
``--clip-norm c / bptt``. Their published test perplexities: small 115.91, medium
82.07 (paper 82.7), large 78.29 (paper 78.4).

``awd-hour`` is AWD-LSTM's regularisation (Merity et al., 2017: "Regularizing and
Optimizing LSTM Language Models") on a model sized for an hour of this project's 2-core
reference host: a 2x650 LSTM with tied embeddings, locked dropout on the embedding output
(0.4), between the layers (0.25) and before the softmax (0.4), word-type dropout 0.1,
weight drop 0.3 on the recurrent matrices (AWD: 0.5 over hundreds of epochs; this run has
about 15), SGD at AWD's lr 30 and clip 0.25 (AWD's loss is a per-token mean too) with its
weight decay 1.2e-6, a per-epoch decay in place of NT-ASGD, and a 58-minute limit. Its
LSTM is PyTorch's ``nn.LSTM``, whose biases start near 0 (uniform in +-1/sqrt(H), no
forget-gate offset): tfpar's default ``--forget-bias 0``.
"""

from __future__ import annotations

import argparse
from typing import Mapping, Sequence

from tfpar import compat
from tfpar.errors import ConfigError


def _zaremba(*, hidden: int, bptt: int, init: float, clip: float, dropout: float,
             decay: float, decay_after: int, epochs: int) -> dict:
    return dict(data="ptb", mode="stream", bptt=bptt, batch_size=20, cell="lstm", layers=2,
                embed_dim=hidden, hidden_dim=hidden, tie_embeddings=False, dropout=dropout,
                init_scale=init, forget_bias=0.0,
                optimizer="sgd", lr=float(bptt), clip_norm=clip / bptt, lr_decay=decay,
                decay_after=decay_after, epochs=epochs)


PRESETS: dict[str, tuple[str, dict]] = {
    "ptb-small": ("ptb_word_lm.py small: 2x200 LSTM, bptt 20, 13 epochs, no dropout",
                  _zaremba(hidden=200, bptt=20, init=0.1, clip=5.0, dropout=0.0, decay=0.5,
                           decay_after=4, epochs=13)),
    "ptb-medium": ("ptb_word_lm.py medium: 2x650 LSTM, bptt 35, 39 epochs, dropout 0.5",
                   _zaremba(hidden=650, bptt=35, init=0.05, clip=5.0, dropout=0.5,
                            decay=0.8, decay_after=6, epochs=39)),
    "ptb-large": ("ptb_word_lm.py large: 2x1500 LSTM, bptt 35, 55 epochs, dropout 0.65",
                  _zaremba(hidden=1500, bptt=35, init=0.04, clip=10.0, dropout=0.65,
                           decay=1 / 1.15, decay_after=14, epochs=55)),
    "awd-hour": ("AWD-LSTM regularisation on a 2x650 tied LSTM, sized for a CPU hour",
                 dict(data="ptb", mode="stream", bptt=35, batch_size=20, cell="lstm", layers=2,
                      embed_dim=650, hidden_dim=650, tie_embeddings=True, init_scale=0.05,
                      dropout=0.4, dropout_hidden=0.25, locked_dropout=True,
                      embed_dropout=0.1, weight_drop=0.3, optimizer="sgd", lr=30.0,
                      clip_norm=0.25, weight_decay=1.2e-6, lr_decay=0.75, decay_after=6,
                      epochs=15, time_limit=58.0)),
}


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the flags that appear in ``argv`` (``--lr 1`` or ``--lr=1``)."""
    by_option = {opt: action.dest for action in compat.parser_actions(parser) for opt in action.option_strings}
    given = set()
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name in by_option:
            given.add(by_option[name])
    return given


def apply_preset(args: argparse.Namespace, parser: argparse.ArgumentParser,
                 argv: Sequence[str], presets: Mapping[str, tuple[str, dict]] = PRESETS
                 ) -> dict:
    """Sets ``args.preset``'s values on ``args`` except where a flag was given.

    Returns:
      The values taken from the preset (empty without ``--preset``).

    Raises:
      ConfigError: an unknown preset name.
    """
    if not args.preset:
        return {}
    if args.preset not in presets:
        raise ConfigError(f"unknown --preset {args.preset!r}; expected one of: "
                          f"{', '.join(presets)}")
    given = given_flags(parser, argv)
    taken = {dest: value for dest, value in presets[args.preset][1].items()
             if dest not in given}
    for dest, value in taken.items():
        setattr(args, dest, value)
    return taken


def describe(parser: argparse.ArgumentParser, values: Mapping[str, object]) -> str:
    """``--bptt 20 --lr 20.0 ...``: preset values as the flags they stand for."""
    actions = {action.dest: action for action in compat.parser_actions(parser) if action.option_strings}

    def as_flag(dest: str, value) -> str:
        action = actions[dest]
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            return action.option_strings[0 if value else 1]
        return f"{action.option_strings[-1]} {value}"

    return " ".join(as_flag(dest, value) for dest, value in values.items())
