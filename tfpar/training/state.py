"""One train state: the model, the optimizer and the counters, built once, saved whole.

Every tool that trains or evaluates (the training run, ``tfpar-evaluate``, the
verify tool, the benchmark, the pipeline sweep) builds its state here, inside the
strategy's scope, so the variables land where the strategy wants them. A checkpoint holds::

    layers/<path>         every model weight, under its Keras path below the model with
                          "/" -> ":" (e.g. layers/rnn_0:lstm_cell:kernel)
    model/...             the same variables as Keras tracks them (tools that restore
                          ``tf.train.Checkpoint(model=...)``): object-graph entries
                          only, each value is written once, under layers/ (the first
                          path TF's walk finds; tests/test_portable_checkpoints.py)
    moments/<slot>        the optimizer's slots, named by Keras (Adam's
                          rnn_0_lstm_cell_kernel_momentum and ..._velocity; SGD's momentum)
    optimizer/...         the optimizer's step count (and its slots again)
    epoch                 epochs finished
    batch_in_epoch        batches of the current epoch consumed (trained or skipped)
    selection/...         model selection by valid perplexity (:class:`Selection`): the
                          best so far, its epoch and step, epochs since, and the
                          learning-rate factor --lr-decay-on-plateau has reached
    (no RNG state: dropout masks are a function of the step, tfpar.model.noise)
    carry/rnn_<i>:<k>     stream mode: the recurrent state the next window starts from,
                          [global batch, w_k] (k: 0 = h, 1 = c for LSTMs, both hidden
                          wide; a custom cell's state_size gives its widths), so a run
                          resumed mid-epoch carries on exactly, under any strategy
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tfpar.config import ModelConfig
from tfpar.model.lm import RNNLanguageModel, build_model

# make_optimizer(epoch variable, lr_scale variable) -> a Keras optimizer (the schedule may
# read the epoch and the plateau decay's factor).
OptimizerFactory = Callable[[tf.Variable, tf.Variable], keras.optimizers.Optimizer]


@dataclasses.dataclass
class Selection:
    """Model selection by valid perplexity, checkpointed with the rest of the state, so a
    resumed run keeps its best, its patience and its decayed rate."""

    best_valid_ppl: tf.Variable  # float64 scalar: the best epoch-end valid ppl (inf: none)
    best_epoch: tf.Variable  # int64 scalar: the epoch (1-based) that reached it (0: none)
    best_step: tf.Variable  # int64 scalar: the step it ended at
    stale_epochs: tf.Variable  # int64 scalar: epochs ended since, without improvement
    lr_scale: tf.Variable  # float32 scalar: --lr-decay-on-plateau's factor so far

    def variables(self) -> dict[str, tf.Variable]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass
class TrainState:
    """What a run trains and what its checkpoints hold."""

    model: RNNLanguageModel
    optimizer: keras.optimizers.Optimizer | None
    epoch: tf.Variable  # int64 scalar: epochs finished
    batch_in_epoch: tf.Variable  # int64 scalar: batches of the current epoch consumed
    # Stream mode: the carried state, one [B, w_k] variable per layer and state part
    # (empty in sentence mode). Written just before each checkpoint (the loop does).
    carry: list[list[tf.Variable]] = dataclasses.field(default_factory=list)
    selection: Selection | None = None

    @property
    def step(self) -> int:
        """Updates applied so far (a skipped non-finite batch is not one)."""
        return int(self.optimizer.iterations.numpy())

    def trackables(self) -> dict:
        """The objects a ``tf.train.Checkpoint`` of this state holds, by name."""
        # "layers" sorts before "model" and "optimizer": a tensor reachable from several
        # objects is saved under the first path TF's breadth-first walk finds.
        out = {"layers": named_weights(self.model), "model": self.model, "epoch": self.epoch,
               "batch_in_epoch": self.batch_in_epoch}
        if self.selection is not None:
            out["selection"] = self.selection.variables()
        if self.carry:
            out["carry"] = {f"rnn_{i}:{k}": v for i, layer in enumerate(self.carry)
                            for k, v in enumerate(layer)}
        if self.optimizer is not None:
            out["moments"] = optimizer_slots(self.optimizer, self.model.name)
            out["optimizer"] = self.optimizer
        return out

    @property
    def averaging(self) -> bool:
        """Whether the optimizer keeps a moving average of the weights (--ema-momentum)."""
        optimizer = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        return bool(optimizer is not None and optimizer.use_ema)

    def use_averages(self) -> None:
        """Puts the moving averages of the trainable weights in the model (the weights a
        run evaluates, keeps as best and exports; Keras' ``finalize_variable_values``)."""
        if self.averaging:
            self.optimizer.finalize_variable_values(self.model.trainable_variables)

    @contextlib.contextmanager
    def averaged(self):
        """The model holds the averaged weights inside (:meth:`use_averages`), its own
        (the ones training goes on from) again after; nothing changes without averaging."""
        if not self.averaging:
            yield
            return
        own = [v.numpy() for v in self.model.trainable_variables]
        self.use_averages()
        try:
            yield
        finally:
            for v, value in zip(self.model.trainable_variables, own):
                v.assign(value)

    def store_carry(self, state) -> None:
        """Keeps ``state`` (global form, or None for zeros) as the carried state."""
        for i, layer in enumerate(self.carry):
            for k, v in enumerate(layer):
                v.assign(tf.zeros_like(v) if state is None else state[i][k])

    def carried(self):
        """The carried state in global form (None: nothing carried, sentence mode)."""
        if not self.carry:
            return None
        return [[tf.convert_to_tensor(v) for v in layer] for layer in self.carry]

    def variables(self) -> list[tf.Variable]:
        """Every variable the state holds (model, optimizer slots and counters)."""
        out = list(self.model.variables) + [self.epoch, self.batch_in_epoch]
        if self.optimizer is not None:
            out += list(self.optimizer.variables)
        return out


def named_weights(model) -> dict[str, tf.Variable]:
    """``{"rnn_0:lstm_cell:kernel": variable, ...}`` for every model weight (there is no
    dropout RNG state to save: the masks are a function of the step,
    ``tfpar.model.noise``)."""
    prefix = model.name + "/"
    return {v.path.removeprefix(prefix).replace("/", ":"): v for v in model.weights
            if v.path.startswith(prefix)}


def average_slot(name: str) -> str:
    """The optimizer's slot holding the moving average of weight ``name``
    ("rnn_0:lstm_cell:kernel" → "rnn_0_lstm_cell_kernel_average", saved under moments/)."""
    return f"{name.replace(':', '_')}_average"


def optimizer_slots(optimizer, model_name: str) -> dict[str, tf.Variable]:
    """``{"rnn_0_lstm_cell_kernel_momentum": slot, ...}``: the optimizer's per-weight
    variables (not its step count or learning rate)."""
    out = {}
    for v in optimizer.variables:
        name = v.path.split("/", 1)[-1].removeprefix(model_name + "_")
        if name not in ("iteration", "learning_rate"):
            out[name] = v
    return out


def build_train_state(scope: contextlib.AbstractContextManager, model_config: ModelConfig,
                      vocab_size: int, *, seed: int,
                      make_optimizer: OptimizerFactory | None = None,
                      initial_weights: list[np.ndarray] | None = None,
                      fixed_shapes: bool = True, carry_rows: int = 0) -> TrainState:
    """Builds the state inside ``scope`` (a strategy plug-in's ``scope()``).

    Args:
      scope: where the variables are created.
      model_config, vocab_size, seed: the model (``tfpar.model.lm.build_model``).
      make_optimizer: builds the optimizer from the epoch variable; None: no optimizer
        (evaluation only).
      initial_weights: weights to start from instead of the seeded initialisation.
      fixed_shapes: False when batch shapes vary (sentence mode; see
        ``tfpar.model.lm.RNNLanguageModel``).
      carry_rows: stream mode: the global batch, whose recurrent state is checkpointed
        (0: none).
    """
    with scope:
        model = build_model(model_config, vocab_size, seed=seed, fixed_shapes=fixed_shapes)
        if initial_weights is not None:
            model.set_weights(initial_weights)
        epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        batch_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="batch_in_epoch")
        selection = Selection(
            tf.Variable(np.inf, dtype=tf.float64, trainable=False, name="best_valid_ppl"),
            tf.Variable(0, dtype=tf.int64, trainable=False, name="best_epoch"),
            tf.Variable(0, dtype=tf.int64, trainable=False, name="best_step"),
            tf.Variable(0, dtype=tf.int64, trainable=False, name="stale_epochs"),
            tf.Variable(1.0, dtype=tf.float32, trainable=False, name="lr_scale"))
        optimizer = None
        if make_optimizer is not None:
            optimizer = make_optimizer(epoch, selection.lr_scale)
            optimizer.build(model.trainable_variables)
    # Plain host variables, outside the strategy: they hold the global batch's state.
    with tf.device("/cpu:0"):
        carry = [[tf.Variable(zeros, trainable=False, name=f"carry_{i}_{k}")
                  for k, zeros in enumerate(layer)]
                 for i, layer in enumerate(model.zero_state(carry_rows))] if carry_rows else []
    return TrainState(model, optimizer, epoch, batch_in_epoch, carry, selection)
