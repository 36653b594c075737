"""The run's settings for TensorBoard's HParams dashboard, written once per model dir.

``tensorboard --logdir runs/`` shows one row per model dir (a *session*): its settings
(:func:`settings`: the config fields that tell two runs apart) and its metrics, each the
last value of a scalar of one of its runs (:data:`METRICS`; valid perplexity is the last
point of ``eval/perplexity``). Both sit in the model dir's root, beside the runs::

    <model-dir>/events.out.tfevents.*.hparams   the experiment (the table's columns)
                                                and the session (this run's values)
    <model-dir>/train/   <model-dir>/eval/      the runs the metrics are read from

Every session writes the same experiment (the columns are :data:`COLUMNS`, whatever the
run), so TensorBoard, which takes the experiment of whichever session it reads first,
shows the same table for any mix of runs. A setting that does not apply to a run (the
forget bias of a GRU, ``bptt`` in sentence mode, ``num_sampled`` with the full softmax)
is left out of its session: an empty cell.

A resumed run finds the session there and writes nothing, so a model dir holds one
session, with the settings its first run started with; a resume that changes one says so
in the log (``config.json`` holds the latest). Only the chief writes
(``tfpar.training.summaries.Writer``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import typing

import tensorflow as tf
from tensorboard.plugins.hparams import api as hp
from tensorboard.plugins.hparams import api_pb2, metadata

from tfpar.config import Config

log = logging.getLogger(__name__)

# The table's columns: (name, config section, field); the name is the field's, but for
# ``data`` (the --data flag) and ``replicas`` (the strategy's, not a config field).
COLUMNS = (
    ("strategy", "dist", "strategy"), ("replicas", None, None),
    ("data", "data", "source"), ("tokenizer", "data", "tokenizer"), ("mode", "data", "mode"),
    ("bptt", "data", "bptt"),
    ("cell", "model", "cell"), ("layers", "model", "layers"),
    ("embed_dim", "model", "embed_dim"), ("hidden_dim", "model", "hidden_dim"),
    ("dropout", "model", "dropout"), ("locked_dropout", "model", "locked_dropout"),
    ("weight_drop", "model", "weight_drop"), ("tie_embeddings", "model", "tie_embeddings"),
    ("init_scale", "model", "init_scale"), ("forget_bias", "model", "forget_bias"),
    ("precision", "model", "precision"), ("softmax", "model", "softmax"),
    ("num_sampled", "model", "num_sampled"),
    ("optimizer", "train", "optimizer"), ("lr", "train", "lr"),
    ("lr_decay", "train", "lr_decay"), ("warmup_steps", "train", "warmup_steps"),
    ("clip_norm", "train", "clip_norm"), ("weight_decay", "train", "weight_decay"),
    ("batch_size", "train", "batch_size"), ("epochs", "train", "epochs"),
    ("seed", "train", "seed"),
)
# (run, tag, display name): the scalars the table shows the last value of.
METRICS = (
    ("eval", "perplexity", "valid perplexity"),
    ("train", "perplexity", "train perplexity"),
)
SUFFIX = ".hparams"  # the session's event file: events.out.tfevents.<time>.<host>...hparams


def settings(config: Config, replicas: int) -> dict[str, bool | int | float | str]:
    """The run's values of :data:`COLUMNS` (only those that apply to it)."""
    model = config.model
    values: dict[str, bool | int | float | str] = {"replicas": replicas}
    for name, section, field in COLUMNS:
        if section is not None:
            values[name] = getattr(getattr(config, section), field)
    # What the run used, not the flag: None means a default that may change.
    values["forget_bias"] = model.initial_forget_bias
    if model.cell != "lstm":
        del values["forget_bias"]
    if config.data.mode != "stream":
        del values["bptt"]
    return {k: v for k, v in values.items() if v is not None}


def experiment() -> tuple[list, list]:
    """The experiment's HParam and Metric lists (the same for every run): each column
    with its flag's help as description and its field's type."""
    defaults = Config()
    fields = {(section.name, field.name): field
              for section in dataclasses.fields(defaults)
              for field in dataclasses.fields(getattr(defaults, section.name))}
    columns = [hp.HParam(name, _Type(int), description="replicas the strategy trains on "
                         "(the global batch is split over them)") if section is None else
               hp.HParam(name, _Type(_value_type(getattr(defaults, section), field)),
                         description=fields[(section, field)].metadata.get("help", ""))
               for name, section, field in COLUMNS]
    metrics = [hp.Metric(tag, group=run, display_name=display) for run, tag, display in METRICS]
    return columns, metrics


def _value_type(section, field: str) -> type:
    """``int`` for a field annotated ``int | None``, and so on."""
    hint = typing.get_type_hints(type(section))[field]
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


class _Type(hp.Domain):
    """A column's type without a domain (the values are whatever runs use): TensorBoard
    then sorts and filters numbers as numbers. The API's domains all name values (a
    Discrete list, an interval), and each session writes the experiment: a domain of
    this run's values would hide the others' in the filters."""

    TYPES = {bool: api_pb2.DATA_TYPE_BOOL, int: api_pb2.DATA_TYPE_FLOAT64,
             float: api_pb2.DATA_TYPE_FLOAT64, str: api_pb2.DATA_TYPE_STRING}

    def __init__(self, dtype: type):
        self._dtype = dtype

    @property
    def dtype(self):
        return self._dtype

    def sample_uniform(self, rng=None):
        raise NotImplementedError("a type, not a set of values to draw from")

    def update_hparam_info(self, hparam_info) -> None:
        hparam_info.type = self.TYPES[self._dtype]


def recorded(model_dir: str) -> dict | None:
    """The settings of the session written in ``model_dir`` (None: there is none)."""
    for path in sorted(tf.io.gfile.glob(os.path.join(model_dir, "events.out.tfevents.*"))):
        try:
            for event in tf.compat.v1.train.summary_iterator(path):
                for value in event.summary.value:
                    if value.tag == metadata.SESSION_START_INFO_TAG:
                        info = metadata.parse_session_start_info_plugin_data(
                            value.metadata.plugin_data.content)
                        return {k: getattr(v, v.WhichOneof("kind"))
                                for k, v in info.hparams.items()}
        except tf.errors.DataLossError:  # a file cut short by a kill: its end is lost
            continue
    return None


def write_session(model_dir: str, values: dict[str, bool | int | float | str]) -> bool:
    """Writes the experiment and the session ``values`` into ``model_dir``'s root unless
    a session is there already; returns whether it wrote. The session is named after the
    model dir, so two runs with the same settings are two rows."""
    before = recorded(model_dir)
    if before is not None:
        changed = sorted(k for k in set(before) | set(values)
                         if _number(before.get(k)) != _number(values.get(k)))
        if changed:
            log.info("TensorBoard HParams keep the settings this model dir started with; "
                     "this run changes %s (config.json holds them)", ", ".join(
                         f"{k} {before.get(k)!r} -> {values.get(k)!r}" for k in changed))
        return False
    columns, metrics = experiment()
    writer = tf.summary.create_file_writer(model_dir, filename_suffix=SUFFIX)
    with writer.as_default():
        hp.hparams_config(hparams=columns, metrics=metrics)
        hp.hparams(values, trial_id=os.path.basename(model_dir.rstrip("/")) or model_dir)
    writer.close()
    return True


def _number(value):
    """A session stores every number as a float (and a bool as a bool)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else value
