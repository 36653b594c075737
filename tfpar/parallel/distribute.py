"""Plug-ins built on ``tf.distribute``: default, one_device and mirrored.

One replica step, run by ``strategy.run`` inside a ``tf.function``:

1. all-reduce the replica's real-token count, so every replica knows the global count;
2. gradients of ``nll_sum / global_count`` on the replica's rows (``tfpar.objective.step``);
3. all-reduce a copy of the gradients, only to get the global norm of the *aggregated*
   gradient, and with it the clip factor (Keras 3's ``clipnorm`` would clip each replica
   before aggregation, which is not what one device does);
4. hand each replica's own gradient times the clip factor to the Keras optimizer, whose
   ``apply_gradients`` sums across replicas itself (handing it the reduced copy would sum
   twice) -- unless the aggregated gradient is not finite, in which case nothing changes.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfpar.parallel import devices as devices_lib
from tfpar.objective import losses
from tfpar.objective import step as steps
from tfpar.config import DistConfig
from tfpar.errors import ConfigError
from tfpar.parallel.base import StrategyPlugin

log = logging.getLogger(__name__)
SUM = tf.distribute.ReduceOp.SUM


class DistributePlugin(StrategyPlugin):
    """Any ``tf.distribute.Strategy`` whose replicas all update the same variables."""

    def __init__(self, name: str, strategy: tf.distribute.Strategy, device_names: list[str]):
        self.name = name
        self.strategy = strategy
        self._devices = device_names

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def devices(self) -> list[str]:
        return self._devices

    def scope(self):
        return self.strategy.scope()

    def distribute(self, dataset_fn):
        if self.num_replicas == 1 and not isinstance(self.strategy, tf.distribute.MirroredStrategy):
            return dataset_fn(None)
        options = tf.distribute.InputOptions(experimental_fetch_to_device=True)
        return self.strategy.distribute_datasets_from_function(dataset_fn, options)

    def _local(self, value):
        """The first replica's copy of a value that is equal on every replica."""
        return self.strategy.experimental_local_results(value)[0]

    def make_train_step(self, model, optimizer, *, clip_norm):
        strategy = self.strategy

        def replica_grads(batch, state):
            ctx = tf.distribute.get_replica_context()
            global_count = ctx.all_reduce(SUM, losses.token_count(batch["targets"]))
            grads, nll_sum, count, final = steps.loss_and_grads(
                model, batch, global_count, state, training=True
            )
            norm = tf.linalg.global_norm(ctx.all_reduce(SUM, grads))
            factor = steps.clip_factor(norm, clip_norm)
            return [g * factor for g in grads], nll_sum, count, norm, steps.detach_state(final)

        def replica_apply(grads):
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function(reduce_retracing=True)
        def train_step(batch, state=None):
            grads, nll, count, norm, final = strategy.run(replica_grads, args=(batch, state))
            norm = self._local(norm)
            # The update is skipped when the aggregated gradient is not finite, so a bad
            # batch never reaches the weights (the loop then stops or moves on, per
            # --on-nan). The condition must sit outside strategy.run: a synchronisation
            # point (the optimizer's all-reduce) may not live inside replica control flow.
            tf.cond(tf.math.is_finite(norm),
                    lambda: strategy.run(replica_apply, args=(grads,)) or tf.no_op(),
                    tf.no_op)
            return dict(
                nll_sum=strategy.reduce(SUM, nll, axis=None),
                count=strategy.reduce(SUM, count, axis=None),
                grad_norm=norm,
                state=final,
            )

        return steps.as_step_output(train_step)

    def make_eval_step(self, model):
        strategy = self.strategy

        def replica_step(batch, state):
            nll_sum, count, final = steps.forward(model, batch, state, training=False)
            return nll_sum, count, final

        @tf.function(reduce_retracing=True)
        def eval_step(batch, state=None):
            nll, count, final = strategy.run(replica_step, args=(batch, state))
            return dict(
                nll_sum=strategy.reduce(SUM, nll, axis=None),
                count=strategy.reduce(SUM, count, axis=None),
                state=final,
            )

        return steps.as_step_output(eval_step)


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


def build_default(dist: DistConfig) -> DistributePlugin:
    """No distribution: TF's default strategy on whatever device TF picks."""
    return DistributePlugin("default", tf.distribute.get_strategy(), ["/device:CPU:0"
                            if devices_lib.num_gpus() == 0 else "/device:GPU:0"])


def build_one_device(dist: DistConfig) -> DistributePlugin:
    """``OneDeviceStrategy`` on ``--devices`` (one device) or the first GPU/CPU."""
    if len(dist.devices) > 1:
        raise ConfigError(f"one_device takes one device, got --devices {','.join(dist.devices)}")
    names = devices_lib.resolve_devices(dist.devices) if dist.devices else \
        devices_lib.default_devices(1)
    return DistributePlugin("one_device", tf.distribute.OneDeviceStrategy(names[0]), names)


def mirrored_devices(dist: DistConfig, default_count: int = 2) -> list[str]:
    """The devices of a single-worker data-parallel strategy (mirrored, tower)."""
    if dist.devices:
        return devices_lib.resolve_devices(dist.devices)
    if devices_lib.num_gpus() >= 2:
        return devices_lib.default_devices(devices_lib.num_gpus())
    count = dist.cpu_devices or default_count
    names = devices_lib.default_devices(count)
    log.info("no GPUs: using %d logical CPU devices (%s)", count, ", ".join(names))
    return names


def build_mirrored(dist: DistConfig) -> DistributePlugin:
    """``MirroredStrategy`` over ``--devices``, all GPUs, or logical CPU devices."""
    names = mirrored_devices(dist)
    ops = cross_device_ops(dist.all_reduce, names)
    return DistributePlugin("mirrored", tf.distribute.MirroredStrategy(names, ops), names)
