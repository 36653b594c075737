"""The interface every strategy plug-in implements.

A plug-in owns four things: the devices (or the ``tf.distribute`` strategy) it runs on,
turning a dataset function into its batches, one training step and one evaluation step.
The per-replica math is shared (``tfpar.objective.step``); plug-ins differ only in placement and
aggregation. The training loop (``tfpar.training.run``) talks only to this interface.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Callable, Iterable

import tensorflow as tf

from tfpar.objective.step import StepOutput

# dataset_fn(input_context) -> per-replica tf.data.Dataset; input_context is a
# tf.distribute.InputContext, or None for plug-ins that split global batches themselves.
DatasetFn = Callable[[tf.distribute.InputContext | None], tf.data.Dataset]
TrainStep = Callable[..., StepOutput]


class StrategyPlugin(abc.ABC):
    """One way of spreading training over devices."""

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

    def scope(self) -> contextlib.AbstractContextManager:
        """Context in which the model and optimizer variables are created."""
        return contextlib.nullcontext()

    # -- Optional: cluster plug-ins (multi_worker, parameter_server) override these; the
    # defaults describe one process that trains synchronously.
    @property
    def num_workers(self) -> int:
        """Processes that compute training steps."""
        return 1

    @property
    def is_server(self) -> bool:
        """True in a task that only serves a cluster (a parameter-server job's worker and
        ps tasks): the training loop calls :meth:`serve` instead of training."""
        return False

    def serve(self) -> None:
        """Serves this task until the process is stopped (only when ``is_server``)."""
        raise NotImplementedError(f"{self.name} has no server tasks")

    def check_config(self, config) -> None:
        """Raises ``ConfigError`` for run settings this plug-in cannot honour."""

    #: True when the train step only *schedules* work (parameter-server training): it
    #: returns a future at once; the loop calls :meth:`join` before :meth:`fetch`-ing it.
    asynchronous: bool = False

    def distribute_to_workers(self, dataset_fn: DatasetFn):
        """Asynchronous plug-ins: the training input, read by each worker on its own."""
        raise NotImplementedError(f"{self.name} is not asynchronous")

    def join(self) -> None:
        """Waits until every scheduled step has finished (no-op when synchronous)."""

    def fetch(self, output) -> StepOutput:
        """A finished step's output as a :class:`StepOutput` (after :meth:`join`)."""
        return output

    @abc.abstractmethod
    def distribute(self, dataset_fn: DatasetFn) -> Iterable:
        """The batches of ``dataset_fn``, in the form this plug-in's steps take."""

    @abc.abstractmethod
    def make_train_step(self, model, optimizer, *, clip_norm: float) -> TrainStep:
        """Returns ``step(batch, state) -> StepOutput`` that updates the model once."""

    @abc.abstractmethod
    def make_eval_step(self, model) -> TrainStep:
        """Returns ``step(batch, state) -> StepOutput`` without gradients (no grad_norm)."""

    def describe(self) -> str:
        return f"{self.name}: {self.num_replicas} replica(s) on {', '.join(self.devices)}"
