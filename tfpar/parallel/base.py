"""The interface every synchronous strategy plug-in implements.

A plug-in says *where* things run; what a step computes is written once, in
``tfpar.objective.step`` (the token count, each replica's gradients, their sum, the
norm, the clip, the finite guard and the update). A plug-in owns:

* its devices (or ``tf.distribute`` strategy) and the scope its variables are made in,
  decided when it is built (``tfpar.parallel.registry``: from the distribution config
  and the model config; nothing changes them later);
* turning a dataset function into the batches its steps take (``distribute``);
* ``replicate``: a function run on each replica's rows, on its device;
* ``sum``: where (and by which reduction) the replicas' scalars are added;
  ``sum_gradients``: where (and by which all-reduce) the replicas' gradients are added,
  each variable's result handed to the step's ``combine``, which gives it the form the
  update takes; ``norm``: where the global norm is taken; ``join_states``: the
  replicas' final states as one;
* ``run_update``: where the one update runs (``place_update``: where each weight's
  gradient is scaled by the clip factor).

The pipeline, whose replicas are micro-batches running through stages, brings its
schedule in through ``gradient_pieces`` and ``loss_pieces`` (by default ``replicate`` of
the step's replica functions). Asynchronous parameter-server training is not a plug-in:
it has no synchronous update to offer (``tfpar.parallel.parameter_server``).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Sequence

import tensorflow as tf

from tfpar.objective import step
from tfpar.objective.step import StepOutput
from tfpar.parallel import rows

# dataset_fn(input_context) -> per-replica tf.data.Dataset; input_context is a
# tf.distribute.InputContext, or None for plug-ins that split global batches themselves.
DatasetFn = Callable[[tf.distribute.InputContext | None], tf.data.Dataset]
TrainStep = Callable[..., StepOutput]
Combine = Callable[[Sequence], Any]


@dataclasses.dataclass
class Parts:
    """One value from every replica (or micro-batch) of a hand-placed plug-in, and where
    their sum is taken: the per-replica form of ``parallel_do``, ``tower`` and
    ``pipeline``. ``rows``: each part's real rows (a final state's, whose padding row of
    a replica without rows is dropped when the states are joined)."""

    values: list
    device: str
    scope: str
    rows: list | None = None


def parts_of(outputs: list, device: str, scope: str, rows: list | None = None):
    """Replica outputs (one nested structure per replica) → the same structure with a
    :class:`Parts` of every replica's value at each leaf."""
    return tf.nest.map_structure(lambda *v: Parts(list(v), device, scope, rows), *outputs)


def sum_parts(values, combine: Combine, scope: str | None = None):
    """Each :class:`Parts` of ``values`` summed by ``combine`` on its device, in the name
    scope ``scope`` (default: the part's own)."""
    def one(p):
        with tf.device(p.device), tf.name_scope(scope or p.scope):
            return combine(p.values)
    return tf.nest.map_structure(one, values)


def join_parts(finals):
    """Final states: each :class:`Parts` concatenated along the rows (a part beyond its
    ``rows`` dropped); anything else is already joined."""
    def one(p):
        if not isinstance(p, Parts):
            return p
        if p.values[0] is None:
            return None
        with tf.device(p.device), tf.name_scope("join_state"):
            return rows.join(p.values, p.rows)
    return tf.nest.map_structure(one, finals)


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

    @property
    def cluster_resolver(self):
        """The ``ClusterResolver`` of a job whose processes must stop together, after
        the same step, on a stop signal to any of them (``tfpar.training.preemption``);
        None: this process stops alone."""
        return None

    def bind(self, model) -> None:
        """Called by the step before it is traced for ``model`` (the pipeline resolves its
        stages here, so a ``--stages`` the model cannot honour fails before tracing)."""

    def describe(self) -> str:
        """One line for the start-up log: the strategy and where it runs."""
        return f"{self.name}: {self.num_replicas} replica(s) on {', '.join(self.devices)}"

    @abc.abstractmethod
    def distribute(self, dataset_fn: DatasetFn) -> Iterable:
        """The batches of ``dataset_fn``, in the form this plug-in's steps take."""

    # -- placement (called while the one step, tfpar.objective.step, is traced)
    @abc.abstractmethod
    def replicate(self, fn: Callable, batch, state) -> Any:
        """``fn(rows, state_rows)`` on every replica's rows of ``batch`` (what
        :meth:`distribute` yields: {"inputs", "targets"} [B, T] int32) and of ``state``
        (the carried state in this plug-in's form, or None), each on its device.

        Returns:
          ``fn``'s output structure, every leaf in this plug-in's per-replica form (what
          :meth:`sum` and :meth:`join_states` take).
        """

    def sum(self, values) -> Any:
        """Each per-replica scalar of ``values`` (token counts, losses) added over the
        replicas where this plug-in adds them. Returns plain tensors. Default: each
        :class:`Parts` added on its device."""
        return sum_parts(values, step.add)

    def sum_gradients(self, grads: list, variables: list, combine: Combine) -> list:
        """The gradients (one per-replica value per trainable variable, in ``variables``'
        order) added over the replicas, in the form :meth:`run_update` hands the update.

        ``combine(parts)`` (the step's, ``tfpar.objective.step.combine_gradients``) is
        one variable's summed gradient in the form the update takes (dense, or with the
        sampled softmax deduplicated rows). A plug-in calls it on every variable: on the
        replicas' parts where it adds them itself, or on its all-reduce's result (one
        part) where the all-reduce adds them (``tf.distribute``, the tower ring).
        Default: each :class:`Parts` combined on its device."""
        return sum_parts(grads, combine)

    def norm(self, grads: list, variables: list) -> tf.Tensor:
        """The global norm of :meth:`sum_gradients`' result."""
        return tf.linalg.global_norm(grads)

    def join_states(self, finals):
        """The replicas' final states (per-replica form) as the carried state of this
        plug-in (see :meth:`global_state`). Default: each :class:`Parts` concatenated."""
        return join_parts(finals)

    def gradient_pieces(self, model, loss, batch, state, global_count: tf.Tensor):
        """``(grads, nll_sum, final_state)`` in per-replica form: every replica's
        :func:`~tfpar.objective.step.replica_gradients` of ``nll / global_count``."""
        grads, nll, _, final = self.replicate(
            lambda rows, s: step.replica_gradients(model, rows, global_count, s, loss=loss),
            batch, state)
        return grads, nll, final

    def loss_pieces(self, model, loss, batch, state):
        """``(nll_sum, count, final_state)`` in per-replica form, without gradients."""
        return self.replicate(lambda rows, s: step.forward(model, rows, s, loss=loss),
                              batch, state)

    def run_update(self, optimizer, update: Callable[[object], None], grads) -> None:
        """Runs ``update(grads)`` (``grads`` from :meth:`sum_gradients`; ``update`` is the
        step's :func:`~tfpar.objective.step.apply_scaled`) where this plug-in's one
        update belongs; ``optimizer`` is the one that applies it. Default: where the
        step runs."""
        update(grads)

    def place_update(self, variable) -> contextlib.AbstractContextManager:
        """Where ``variable``'s gradient is scaled by the clip factor before the update
        (default: where :meth:`run_update` runs it)."""
        return contextlib.nullcontext()

    # -- the carried recurrent state (stream mode) in a form every strategy shares
    def global_state(self, state):
        """This plug-in's form of a carried state → the global batch's: one [B, H] tensor
        per layer and state part (what a checkpoint holds)."""
        return state

    def local_state(self, state):
        """The global batch's state → this plug-in's form (inverse of global_state)."""
        return state
