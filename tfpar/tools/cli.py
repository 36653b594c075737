"""Command-line plumbing shared by the commands: flags → Config, logging, error handling.

Nothing here imports TensorFlow at module level (the imports of tfpar's TF modules sit in
the functions that need them): scripts must set TF's log level before TensorFlow is
imported and split the CPU into logical devices before it initialises.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import typing
from typing import Callable, Mapping, Sequence

from tfpar import compat
from tfpar import config as cfg
from tfpar.errors import TfparError
from tfpar.parallel import registry
from tfpar.tools.parsing import Parser

# The flags are made from the Config's fields: a flag's default and help are its
# field's (tfpar.config.flag), so ``Config()`` trains what ``tfpar-train`` with no flags
# trains and a new field is a new flag.


def add_preset_flag(p: argparse.ArgumentParser) -> None:
    from tfpar.tools.presets import PRESETS

    p.add_argument("--preset", default="",
                   help="a named configuration; flags given override its values: "
                        + "; ".join(f"{name}: {desc}" for name, (desc, _) in PRESETS.items()))


# The --help group of each section's flags, in --help's order; a field's ``group``
# metadata moves it to another (--init-from is a run setting shown with training's).
GROUPS = {"dist": "distribution", "data": "data", "model": "model", "train": "training",
          "run": "outputs"}
SECTIONS = {"data": cfg.DataConfig, "model": cfg.ModelConfig, "train": cfg.TrainConfig,
            "dist": cfg.DistConfig, "run": cfg.RunConfig}
# A field's ``names`` metadata -> the names its --help lists (tfpar.config.flag).
NAMES: dict[str, Callable[[], list[str]]] = {"strategies": registry.names}
# --synthetic-sentences TRAIN,VALID,TEST sets three DataConfig fields.
SYNTHETIC = ("synthetic_train", "synthetic_valid", "synthetic_test")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One config field's command-line flag (made from the field: :func:`tfpar.config.flag`)."""

    section: str
    field: str
    option: str          # "--embed-dim"
    dest: str            # argparse's attribute: "embed_dim"
    group: str
    kind: type           # bool, int, float, str or tuple (parsed by ``parse``)
    default: object
    optional: bool       # None is a value (it means "the run decides")
    metadata: Mapping

    def add_to(self, group: compat.ArgumentGroup) -> None:
        help_ = self.metadata["help"]
        if "names" in self.metadata:  # a list kept where its names live
            help_ += " " + " | ".join(NAMES[self.metadata["names"]]())
        kwargs: dict = {"dest": self.dest}
        if self.kind is bool and (self.default or self.optional):
            # --x / --no-x; argparse adds "(default: ...)" itself where the default is a bool.
            group.add_argument(self.option, action=argparse.BooleanOptionalAction,
                               default=self.default, help=help_, **kwargs)
            return
        if self.kind is bool:
            group.add_argument(self.option, action="store_true", help=help_, **kwargs)
            return
        if self.kind is tuple:
            default = ",".join(map(str, self.default))
        else:
            default = self.default
            if self.kind in (int, float):
                kwargs["type"] = self.kind
        if "metavar" in self.metadata:
            kwargs["metavar"] = self.metadata["metavar"]
        if default not in ("", None) and not re.search(r"\(default|default:", help_):
            help_ += " (default: %(default)s)"
        group.add_argument(self.option, default=default, help=help_, **kwargs)

    def value(self, args: argparse.Namespace):
        """The field's value from the parsed ``args``."""
        value = getattr(args, self.dest)
        if self.kind is tuple:
            return self.metadata["parse"](value)
        return value


def _kind(annotation) -> tuple[type, bool]:
    """``int | None`` → ``(int, True)``; ``tuple[str, ...]`` → ``(tuple, False)``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = len(args) < len(typing.get_args(annotation))
    if optional:
        annotation = args[0]
    return typing.get_origin(annotation) or annotation, optional


def config_flags(section: str) -> list[Flag]:
    """The flags of one Config section (``"data"``, ``"model"``, ...), in field order."""
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    flags = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        name = f.metadata.get("name", f.name.replace("_", "-"))
        kind, optional = _kind(hints[f.name])
        flags.append(Flag(section, f.name, f"--{name}", name.replace("-", "_"),
                          f.metadata.get("group", GROUPS[section]), kind, f.default,
                          optional, f.metadata))
    return flags


def _add_flags(p: argparse.ArgumentParser, sections: Sequence[str]) -> None:
    every = [f for s in sections for f in config_flags(s)]
    groups = {}
    for title in GROUPS.values():
        flags = [f for f in every if f.group == title]
        if flags:
            groups[title] = p.add_argument_group(title)
        for f in flags:
            f.add_to(groups[title])
    if "data" in sections:
        d = cfg.DataConfig()
        groups["data"].add_argument(
            "--synthetic-sentences", metavar="TRAIN,VALID,TEST",
            default=",".join(str(getattr(d, name)) for name in SYNTHETIC),
            help="synthetic corpus size: train,valid,test sentences (default: %(default)s)")


def add_distribution_flags(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`tfpar.config.DistConfig` (every command that places work)."""
    _add_flags(p, ["dist"])


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """A flag for every field of :class:`tfpar.config.Config`, grouped for --help."""
    _add_flags(p, list(GROUPS))


def train_parser(prog: str = "tfpar-train", *, raising: bool = False
                 ) -> argparse.ArgumentParser:
    """``tfpar-train``'s flags (``raising``: errors raise ConfigError, :class:`Parser`)."""
    p = Parser(
        prog=prog,
        raising=raising,
        description="Train an RNN language model on one or many devices, evaluate it, "
                    "write TensorBoard events and export a SavedModel.",
        # No abbreviations: a preset merges with the flags given by their full names, so
        # "--epoch 3" would be accepted here and then lose to the preset's epochs.
        allow_abbrev=False,
    )
    add_preset_flag(p)
    add_config_flags(p)
    p.add_argument("-v", "--verbose", action="store_true", help="TensorFlow's own logs too")
    return p


def synthetic_sentences(text: str) -> dict[str, int]:
    """``"200,20,20"`` → the three synthetic-corpus fields of :class:`DataConfig`."""
    return dict(zip(SYNTHETIC, cfg.parse_ints("--synthetic-sentences", text, 3)))


def section_from_args(section: str, a: argparse.Namespace):
    """One Config section (a validated dataclass) from the parsed flags ``a``."""
    values = {f.field: f.value(a) for f in config_flags(section)}
    if section == "data":
        values.update(synthetic_sentences(a.synthetic_sentences))
    return SECTIONS[section](**values)


def dist_config_from_args(a: argparse.Namespace) -> cfg.DistConfig:
    """The DistConfig of :func:`add_distribution_flags`' flags (every script that takes
    them)."""
    return section_from_args("dist", a)


def config_from_args(a: argparse.Namespace) -> cfg.Config:
    """Builds and validates the Config the flags describe."""
    return cfg.Config(**{section: section_from_args(section, a) for section in SECTIONS})


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(verbose: bool = False) -> None:
    """Human logs on stderr; TensorFlow's C++ chatter only with --verbose.

    tfpar's records go to one handler on the ``tfpar`` logger, which writes to the
    current ``sys.stderr``.
    """
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logger = logging.getLogger("tfpar")
    logger.setLevel(logging.INFO)
    # Libraries imported later may configure the root logger; tfpar's records go to
    # this one handler only, so they are never printed twice.
    logger.propagate = False
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname).1s %(name)s: %(message)s"))
        logger.addHandler(handler)
    if not verbose:
        for name in ("absl", "tensorflow", "h5py"):
            logging.getLogger(name).setLevel(logging.ERROR)


def prepare_runtime(dist: cfg.DistConfig,
                    too_late: str = "set --cpu-devices before anything runs on TensorFlow"
                    ) -> None:
    """Logical CPU devices and placement options; must run before TF initialises.

    Raises:
      DeviceError: TensorFlow was initialised with fewer logical CPU devices than ``dist``
        needs (the message ends with ``too_late``: what to do instead).
    """
    from tfpar.parallel import devices

    # First: TF reads the placement log setting only when its runtime initialises (and
    # configure_cpu_devices initialises it); set later, the log stays silent.
    devices.set_placement_options(log_placement=dist.log_device_placement,
                                  soft_placement=dist.soft_placement)
    devices.configure_gpus(dist.cpu_only)  # GPUs hidden, or memory growth; usable or error
    # Cluster strategies configure TF's collective/gRPC runtime, which must happen before
    # it initialises (listing devices would); they use one CPU device per task.
    count = registry.cpu_devices_needed(dist)
    # Thread pools too are fixed when the runtime initialises: before the devices.
    devices.configure_threads(registry.intra_op_threads(dist, count),
                              requested=bool(dist.intra_op_threads))
    if not registry.traits(dist.strategy).cluster:
        devices.configure_cpu_devices(count, too_late=too_late)


def run_main(body: Callable[[], int | None]) -> int:
    """Runs a script body: a user error becomes one line on stderr and exit status 2."""
    try:
        return body() or 0
    except TfparError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def train_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 argv: Sequence[str]) -> cfg.Config:
    """The Config of training flags ``argv`` parsed into ``args``: ``--preset``'s values
    for the flags not given, then :func:`config_from_args`; a preset is logged with what
    it set. What ``tfpar-train`` and :func:`tfpar.make_config` both run.

    Raises:
      ConfigError: an unknown preset, or values the Config refuses.
    """
    from tfpar.tools import presets

    taken = presets.apply_preset(args, parser, argv)
    config = config_from_args(args)
    if args.preset:
        log = logging.getLogger("tfpar.tools.cli")
        log.info("preset %s (%s): %s; flags given override it", args.preset,
                 presets.PRESETS[args.preset][0], presets.describe(parser, taken))
        log.info("configuration: %s", json.dumps(
            {k: config.to_dict()[k] for k in ("data", "model", "train")},
            separators=(",", ":")))
    return config


def train_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-train``: flags (over ``--preset``) → Config → ``train_and_evaluate``;
    ``prog`` names the command in usage lines (default ``tfpar-train``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = train_parser(prog or "tfpar-train")
    args = parser.parse_args(argv)
    setup_logging(args.verbose or args.log_device_placement)

    def body():
        config = train_config(parser, args, argv)
        prepare_runtime(config.dist)
        from tfpar.training.run import train_and_evaluate

        train_and_evaluate(config)

    return run_main(body)
