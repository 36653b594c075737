"""Plug-ins built on ``tf.distribute``: default, one_device and mirrored.

Placement: ``strategy.run`` runs a replica's share of the one step
(``tfpar.objective.step``) on each replica's device. Sums: scalars (the token count, the
loss) with ``strategy.reduce``; the gradients all-reduced once, by the strategy's
cross-device ops, into a copy of the sum on every replica (given its form by the step's
``combine``), which gives the global norm (for the clip factor) and is what every
replica's optimizer applies, told not to sum again (Keras 3's ``apply_gradients`` all-reduces in a replica context by itself, which
would be a second all-reduce of every gradient each step; see
:func:`tfpar.compat.summed_already`).
Sparse gradients (``tf.IndexedSlices``, the sampled softmax's) all-reduce as a gather of
every replica's rows, then each replica sums repeated rows (the step's ``combine``)
before the norm.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfpar import compat
from tfpar.parallel import devices as devices_lib
from tfpar.config import DistConfig, ModelConfig
from tfpar.errors import ConfigError
from tfpar.parallel import rows
from tfpar.parallel.base import StrategyPlugin

log = logging.getLogger(__name__)
SUM = tf.distribute.ReduceOp.SUM


class DistributePlugin(StrategyPlugin):
    """Any ``tf.distribute.Strategy`` whose replicas all update the same variables."""

    def __init__(self, name: str, strategy: tf.distribute.Strategy, device_names: list[str],
                 cross_device_ops: tf.distribute.CrossDeviceOps | None = None):
        self.name = name
        self.strategy = strategy
        self._devices = device_names
        # What sums the gradients across devices (mirrored's; None: one device, nothing
        # to sum). The strategy is built with it, so this is the one it uses.
        self.cross_device_ops = cross_device_ops

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def devices(self) -> list[str]:
        return self._devices

    def scope(self):
        return self.strategy.scope()

    def describe(self) -> str:
        """The start-up log's ``strategy ...`` line: with mirrored's cross-device
        reduction named (``NcclAllReduce`` on 2 or more GPUs), the line a GPU report
        quotes."""
        line = super().describe()
        if self.cross_device_ops is None:
            return line
        return f"{line}; all-reduce {all_reduce_name(self.cross_device_ops, self.num_replicas)}"

    def distribute(self, dataset_fn):
        if self.num_replicas == 1 and not isinstance(self.strategy, tf.distribute.MirroredStrategy):
            return dataset_fn(None)
        options = tf.distribute.InputOptions(experimental_fetch_to_device=True)
        return self.strategy.distribute_datasets_from_function(dataset_fn, options)

    def _local(self, value):
        """The first replica's copy of a value that is equal on every replica."""
        return self.strategy.experimental_local_results(value)[0]

    def replicate(self, fn, batch, state):
        """``fn`` on every replica's share (a share of no rows, which ``tf.distribute``
        hands out when one multi-worker input pipeline has ended before another, becomes
        one padding row: ``rows.at_least_one_row``)."""
        def share(rows_, state_):
            if not rows_["targets"].shape[0]:  # rows unknown when traced, or none
                rows_ = rows.at_least_one_row(rows_)
            return fn(rows_, state_)
        return self.strategy.run(share, args=(batch, state))

    def sum(self, values):
        """Scalars (losses, token counts): ``strategy.reduce``."""
        return tf.nest.map_structure(lambda v: self.strategy.reduce(SUM, v, axis=None), values)

    def sum_gradients(self, grads, variables, combine):
        """One all-reduce of every gradient (the strategy's cross-device ops, as Keras'
        optimizer would run it), then ``combine`` on each replica's copy of the sum.

        Summed here, once, because the clip factor needs the norm of the sum before the
        update (Keras 3's ``clipnorm`` would clip each replica before aggregation, which
        is not what one device does); :meth:`run_update` then keeps the optimizer from
        summing again."""
        summed = self.strategy.extended.batch_reduce_to(SUM, [(g, g) for g in grads])
        return self.strategy.run(lambda gs: [combine([g]) for g in gs], args=(summed,))

    def norm(self, grads, variables):
        return tf.linalg.global_norm([self._local(g) for g in grads])

    def join_states(self, finals):
        return finals

    def run_update(self, optimizer, update, grads):
        """On every replica (the optimizer's update of a mirrored variable), told that
        the gradients it gets are summed already."""
        compat.summed_already(optimizer)
        self.strategy.run(update, args=(grads,))

    def global_state(self, state):
        if state is None or self.num_replicas == 1:
            return state
        # Replica r holds rows shard_bounds(B, R)[r], in replica order (parallel.rows).
        return tf.nest.map_structure(lambda v: self.strategy.gather(v, axis=0), state)

    def local_state(self, state):
        if state is None or self.num_replicas == 1:
            return state
        replicas = self.num_replicas
        values = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: rows.state_share(state, replicas, ctx.replica_id_in_sync_group))
        # One replica in this process (a worker of multi_worker): its rows as plain
        # tensors, the form strategy.run returns the state in, so the training call's
        # loop carries one form from its first window on.
        local = self.strategy.experimental_local_results(values)
        return local[0] if len(local) == 1 else values


def all_reduce_name(ops: tf.distribute.CrossDeviceOps, replicas: int) -> str:
    """``NcclAllReduce``, ``HierarchicalCopyAllReduce``, ``ReductionToOneDevice``: the
    ``tf.distribute`` class of ``ops``; one replica has nothing to sum, and says so."""
    name = type(ops).__name__
    return name + (" (one replica: nothing to reduce)" if replicas == 1 else "")


def cross_device_ops(all_reduce: str, device_names: list[str]):
    """Maps ``--all-reduce`` to a ``tf.distribute`` CrossDeviceOps.

    ``auto`` is NCCL when every device is a GPU (and there are ≥2), and reduction to one
    device otherwise: the right choice for CPUs, where NCCL does not exist.
    """
    gpus = [d for d in device_names if "GPU" in d.upper()]
    all_gpu = len(gpus) == len(device_names) and len(gpus) >= 2
    if all_reduce == "auto":
        all_reduce = "nccl" if all_gpu else "reduce_to_one"
        log.info("all-reduce: auto chose %s", all_reduce)
    if all_reduce == "nccl":
        if devices_lib.num_gpus() == 0 or not all_gpu:
            raise ConfigError(
                "--all-reduce nccl needs 2 or more GPUs but this run's devices are "
                f"{', '.join(device_names)}; use --all-reduce auto or reduce_to_one"
            )
        return tf.distribute.NcclAllReduce()
    if all_reduce == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice(reduce_to_device=device_names[0])


def build_default(dist: DistConfig, model: ModelConfig | None = None) -> DistributePlugin:
    """No distribution: TF's default strategy on whatever device TF picks."""
    return DistributePlugin("default", tf.distribute.get_strategy(), ["/device:CPU:0"
                            if devices_lib.num_gpus() == 0 else "/device:GPU:0"])


def build_one_device(dist: DistConfig, model: ModelConfig | None = None
                     ) -> DistributePlugin:
    """``OneDeviceStrategy`` on ``--devices`` (one device) or the first GPU/CPU."""
    if len(dist.devices) > 1:
        raise ConfigError(f"one_device takes one device, got --devices {','.join(dist.devices)}")
    names = devices_lib.resolve_devices(dist.devices) if dist.devices else \
        devices_lib.default_devices(1)
    return DistributePlugin("one_device", tf.distribute.OneDeviceStrategy(names[0]), names)


def build_mirrored(dist: DistConfig, model: ModelConfig | None = None) -> DistributePlugin:
    """``MirroredStrategy`` over ``--devices``, all GPUs, or logical CPU devices."""
    names = devices_lib.data_parallel_devices(dist)
    ops = cross_device_ops(dist.all_reduce, names)
    return DistributePlugin("mirrored", tf.distribute.MirroredStrategy(names, ops), names, ops)
