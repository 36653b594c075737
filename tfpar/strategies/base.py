"""The interface every strategy plug-in implements.

A plug-in owns four things: the devices (or the ``tf.distribute`` strategy) it runs on,
turning a dataset function into its batches, one training step and one evaluation step.
The per-replica math is shared (``tfpar.steps``); plug-ins differ only in placement and
aggregation. The training loop (``tfpar.train``) talks only to this interface.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Callable, Iterable

import tensorflow as tf

from tfpar.steps import StepOutput

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
