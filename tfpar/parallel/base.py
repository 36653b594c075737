"""The interface every synchronous strategy plug-in implements.

A plug-in says *where* things run and *how* per-device gradients become one; what a
step computes is written once, in ``tfpar.objective.step``. A plug-in owns:

* its devices (or ``tf.distribute`` strategy) and the scope its variables are made in;
* turning a dataset function into the batches its steps take (``distribute``);
* ``gradients``: each replica's :func:`~tfpar.objective.step.replica_gradients` on its
  rows, placed on its device, and their sum (the aggregation);
* ``run_update``: where the one update runs (``place_update``: where each weight's
  gradient is scaled by the clip factor); the update itself, the clip factor times the
  aggregated gradient applied by the optimizer once, is the step's;
* ``losses``: each replica's forward pass on its rows, summed (evaluation).

The clip, the finite guard and the step function are not a plug-in's business:
:meth:`make_train_step` and :meth:`make_eval_step` are the one step of
``tfpar.objective.step``. Asynchronous parameter-server training is not a plug-in: it
has no synchronous update to offer (``tfpar.parallel.parameter_server``).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Callable, Iterable

import tensorflow as tf

from tfpar.objective import step
from tfpar.objective.step import Aggregated, StepOutput

# dataset_fn(input_context) -> per-replica tf.data.Dataset; input_context is a
# tf.distribute.InputContext, or None for plug-ins that split global batches themselves.
DatasetFn = Callable[[tf.distribute.InputContext | None], tf.data.Dataset]
TrainStep = Callable[..., StepOutput]


class StrategyPlugin(abc.ABC):
    """One way of spreading a synchronous training step over devices."""

    #: Registry name, e.g. "mirrored".
    name: str = ""

    @property
    @abc.abstractmethod
    def num_replicas(self) -> int:
        """Data-parallel replicas (towers) a global batch is split into."""

    @property
    @abc.abstractmethod
    def devices(self) -> list[str]:
        """Devices the computation runs on."""

    @property
    def is_chief(self) -> bool:
        """Whether this process writes events, checkpoints, metrics and exports."""
        return True

    @property
    def num_workers(self) -> int:
        """Processes that compute training steps."""
        return 1

    def scope(self) -> contextlib.AbstractContextManager:
        """Context in which the model and optimizer variables are created."""
        return contextlib.nullcontext()

    def check_config(self, config) -> None:
        """Raises ``ConfigError`` for run settings this plug-in cannot honour."""

    def describe(self) -> str:
        return f"{self.name}: {self.num_replicas} replica(s) on {', '.join(self.devices)}"

    @abc.abstractmethod
    def distribute(self, dataset_fn: DatasetFn) -> Iterable:
        """The batches of ``dataset_fn``, in the form this plug-in's steps take."""

    # -- the step pieces (called while the one step is traced)
    @abc.abstractmethod
    def gradients(self, model, batch, state) -> Aggregated:
        """Placement and aggregation of one training step's gradients.

        Args:
          model: the model (variables made in :meth:`scope`).
          batch: what :meth:`distribute` yields: {"inputs", "targets"} [B, T] int32.
          state: the recurrent state :meth:`gradients` returned for the previous window
            (stream mode), or None.
        """

    def run_update(self, optimizer, update: Callable[[object], None], grads) -> None:
        """Runs ``update(grads)`` (``grads`` from :meth:`gradients`; ``update`` is the
        step's :func:`~tfpar.objective.step.apply_scaled`) where this plug-in's one
        update belongs; ``optimizer`` is the one that applies it. Default: where the
        step runs."""
        update(grads)

    def place_update(self, variable) -> contextlib.AbstractContextManager:
        """Where ``variable``'s gradient is scaled by the clip factor before the update
        (default: where :meth:`run_update` runs it)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def losses(self, model, batch, state) -> tuple:
        """``(nll_sum, count, final_state)`` of the whole batch, without gradients."""

    # -- the carried recurrent state (stream mode) in a form every strategy shares
    def global_state(self, state):
        """This plug-in's form of a carried state → the global batch's: one [B, H] tensor
        per layer and state part (what a checkpoint holds)."""
        return state

    def local_state(self, state):
        """The global batch's state → this plug-in's form (inverse of global_state)."""
        return state

    # -- the one step, wrapped around the pieces
    def make_train_step(self, model, optimizer, *, clip_norm: float) -> TrainStep:
        """``step(batch, state) -> StepOutput`` that updates the model once."""
        return step.make_train_step(self, model, optimizer, clip_norm=clip_norm)

    def make_train_steps(self, model, optimizer, *, clip_norm: float):
        """``steps(iterator, state, n) -> CallOutput``: up to n updates per call
        (``--steps-per-execution``; ``tfpar.objective.step.make_train_steps``)."""
        return step.make_train_steps(self, model, optimizer, clip_norm=clip_norm)

    def make_eval_step(self, model) -> TrainStep:
        """``step(batch, state) -> StepOutput`` without gradients (no grad_norm)."""
        return step.make_eval_step(self, model)
