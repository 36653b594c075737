"""The Python API: ``tfpar-train`` from a notebook or a script.

    import tfpar

    config = tfpar.make_config(strategy="mirrored", cpu_devices=2, max_steps=100)
    metrics = tfpar.train(config)          # or tfpar.train(max_steps=100, ...)
    metrics["valid_ppl"]

Every setting is one of ``tfpar-train``'s flags, named by its keyword (``--max-steps
100`` is ``max_steps=100``, ``--no-export`` is ``no_export=True``, ``--no-tie-embeddings``
is ``tie_embeddings=False``; ``preset="ptb-small"`` as ``--preset``, the settings given
overriding it). :func:`make_config` turns the settings into that command line and builds
the Config through the very parser and code ``tfpar-train`` uses, so every default is
the command's. :func:`train` runs what ``tfpar-train`` runs and returns the metrics
(the dict ``--metrics-json`` writes). Errors raise :class:`tfpar.errors.TfparError`
subclasses with a one-line message.

TensorFlow fixes its logical CPU devices when it initialises: the first run of a process
decides how many there are (``cpu_devices``, or what the strategy needs). A later run
that needs more fails with a DeviceError saying so; restart the process (the notebook's
kernel) for it.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Mapping, Sequence

from tfpar import compat
from tfpar.config import Config
from tfpar.errors import ConfigError
from tfpar.tools import cli

# The end of the DeviceError when TensorFlow already runs with too few CPU devices.
TOO_LATE = ("restart the Python process (a notebook's kernel) and call tfpar.train before "
            "anything else runs on TensorFlow")


def _negated(actions: Mapping[str, argparse.Action], name: str, value: Any
             ) -> tuple[str, Any]:
    """``no_export=True`` → ``("export", False)``: a ``--x / --no-x`` switch's ``--no-x``
    spelled as a keyword; any other setting unchanged."""
    switch = actions.get(name[3:]) if name.startswith("no_") and name not in actions else None
    if not isinstance(switch, argparse.BooleanOptionalAction):
        return name, value
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False")
    return name[3:], not value


def settings_argv(parser: argparse.ArgumentParser, settings: Mapping[str, Any]) -> list[str]:
    """The command line that says what keyword ``settings`` say: ``{"max_steps": 100,
    "no_export": True, "tie_embeddings": False, "synthetic_sentences": (200, 20, 20)}``
    → ``--max-steps 100 --no-export --no-tie-embeddings --synthetic-sentences
    200,20,20``. None leaves a setting at its default; a list or tuple is written
    comma-separated.

    Raises:
      ConfigError: a keyword that is no flag's, or a switch given a non-boolean.
    """
    actions = {a.dest: a for a in compat.parser_actions(parser) if a.option_strings and a.dest != "help"}
    settings = dict(_negated(actions, name, value) for name, value in settings.items())
    for name in settings:
        if name not in actions:
            close = difflib.get_close_matches(name, actions, n=1)
            raise ConfigError(
                f"unknown setting {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                "settings are tfpar-train's flags as keywords (--max-steps 100: "
                "max_steps=100; tfpar-train --help lists them)")
    argv: list[str] = []
    for dest, value in settings.items():
        action = actions[dest]
        flag = action.option_strings[-1]  # the long one: --verbose, not -v
        if value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag
            if not isinstance(value, bool):
                raise ConfigError(f"{dest}={value!r} must be True or False")
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true
            if not isinstance(value, bool):
                raise ConfigError(f"{dest}={value!r} must be True or False")
            if value:
                argv.append(flag)
        else:
            if isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            argv += [flag, str(value)]
    return argv


def make_config(**settings: Any) -> Config:
    """The Config ``tfpar-train`` builds from the flags ``settings`` name (see the
    module's docstring); no settings: the command's defaults.

    Raises:
      ConfigError: an unknown setting, a value the flag's parser refuses, or one the
        Config refuses (the same one-line messages as the command's).
    """
    parser = cli.train_parser(raising=True)  # ConfigError where the command exits 2
    argv = settings_argv(parser, settings)
    args = parser.parse_args(argv)
    cli.setup_logging(args.verbose or args.log_device_placement)
    return cli.train_config(parser, args, argv)


def train(config: Config | None = None, /, **settings: Any) -> dict[str, Any]:
    """Trains, evaluates and exports as ``tfpar-train`` does; returns the final metrics.

    Args:
      config: what to run (:func:`make_config`), or None to build it from ``settings``.
      **settings: tfpar-train's flags as keywords, when no ``config`` is given.

    Returns:
      The metrics ``--metrics-json`` writes (``valid_ppl``, ``test_ppl``, ``steps``,
      ``export_path``, ...; empty in a parameter-server worker or ps task, which only
      serve).

    Raises:
      ConfigError: both ``config`` and ``settings``, or a bad setting.
      DeviceError: TensorFlow already runs with fewer logical CPU devices than needed.
      TfparError: whatever ``tfpar-train`` would stop on, with its message.
    """
    if config is None:
        config = make_config(**settings)
    elif settings:
        raise ConfigError(f"give train() a Config or settings, not both (got a Config and "
                          f"{', '.join(sorted(settings))})")
    else:
        cli.setup_logging(config.dist.log_device_placement)
    cli.prepare_runtime(config.dist, too_late=TOO_LATE)
    from tfpar.training.run import train_and_evaluate

    return train_and_evaluate(config)


__all__: Sequence[str] = ("make_config", "train", "Config")
