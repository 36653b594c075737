"""``parallel_do``: PaddlePaddle's ``ParallelDo`` as a tfpar strategy, the smallest one.

``ParallelDo`` defines the network once; the wrapper splits the input, runs the block on
every device and merges. Here the block is the one replica step of
``tfpar.objective.step``, and this module is only the wrapper::

    split:  global batch [B, T] -> rows of device d (shard_rows: sizes differ by <= 1)
    run:    with tf.device(d): g_d, nll_d, n_d = replica_gradients(rows_d, N)
    merge:  g = sum_d g_d (on the first device); nll, n summed; states concatenated

It is also the worked example of what a synchronous strategy consists of: a class with
``num_replicas``, ``devices``, ``distribute``, ``gradients``, ``apply`` and ``losses``,
a builder, and one line in ``tfpar.parallel.STRATEGIES``. (``tower`` is the same idea
with a choice of variable device and a ring reduction.)
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.config import DistConfig
from tfpar.data.pipeline import shard_bounds, shard_rows, state_rows
from tfpar.objective import losses, step
from tfpar.parallel.base import StrategyPlugin
from tfpar.parallel.distribute import mirrored_devices


class ParallelDo(StrategyPlugin):
    """Split, run on every device, merge; the variables live on the first device."""

    name = "parallel_do"

    def __init__(self, device_names: list[str]):
        self._devices = list(device_names)

    @property
    def num_replicas(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> list[str]:
        return self._devices

    def scope(self):
        return tf.device(self._devices[0])

    def distribute(self, dataset_fn):
        return dataset_fn(None)  # global batches: the step splits them

    def _run(self, fn, batch, state):
        """``fn(rows, state rows)`` on each device; its outputs, and the row counts."""
        rows = tf.shape(batch["targets"])[0]
        outs, sizes = [], []
        for i, device in enumerate(self._devices):
            start, size = shard_bounds(rows, self.num_replicas, i)
            part = None if state is None else tf.nest.map_structure(
                lambda s, start=start, size=size: state_rows(s, start, size), state)
            with tf.device(device):
                outs.append(fn(shard_rows(batch, self.num_replicas, i), part))
            sizes.append(size)
        return outs, sizes

    def _merge_states(self, finals, sizes):
        if finals[0] is None:
            return None
        return tf.nest.map_structure(
            lambda *parts: tf.concat([p[:n] for p, n in zip(parts, sizes)], 0), *finals)

    def gradients(self, model, batch, state):
        count = losses.token_count(batch["targets"])
        outs, sizes = self._run(
            lambda rows, s: step.replica_gradients(model, rows, count, s), batch, state)
        grads, nlls, counts, finals = zip(*outs)
        with tf.device(self._devices[0]):
            total = [tf.add_n(list(g)) for g in zip(*grads)]
            return step.Aggregated(total, tf.linalg.global_norm(total), tf.add_n(nlls),
                                   tf.add_n(counts), self._merge_states(finals, sizes))

    def apply(self, optimizer, variables, grads, factor):
        with tf.device(self._devices[0]):
            optimizer.apply_gradients(zip([g * factor for g in grads], variables))

    def losses(self, model, batch, state):
        outs, sizes = self._run(
            lambda rows, s: step.forward(model, rows, s, training=False), batch, state)
        nlls, counts, finals = zip(*outs)
        return tf.add_n(nlls), tf.add_n(counts), self._merge_states(finals, sizes)


def build_parallel_do(dist: DistConfig) -> ParallelDo:
    """On ``--devices``, all GPUs, or ``--cpu-devices`` logical CPUs (default 2)."""
    return ParallelDo(mirrored_devices(dist))
