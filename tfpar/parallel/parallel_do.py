"""``parallel_do``: PaddlePaddle's ``ParallelDo`` as a tfpar strategy, the smallest one.

``ParallelDo`` defines the network once; the wrapper splits the input, runs the block on
every device and merges. Here the block is the one replica step of
``tfpar.objective.step``, and this module is only the wrapper::

    split:  global batch [B, T] -> rows of device d (rows.split: sizes differ by <= 1)
    run:    with tf.device(d): fn(rows_d)        (the step's token count, its gradients)
    merge:  sum_d (on the variable device); states concatenated

It is also the worked example of what a synchronous strategy consists of: a class with
``num_replicas``, ``devices``, ``scope``, ``distribute``, ``replicate``, ``sum_gradients``,
``norm`` and ``run_update`` (the base class's ``sum`` adds its ``Parts``), a builder of
``(DistConfig, ModelConfig)``, and one line in ``tfpar.parallel.registry.STRATEGIES``. ``tower``
(``tfpar.parallel.tower``) is this strategy with a choice of variable device and of
reduction (a ring).
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.config import DistConfig, ModelConfig
from tfpar.parallel import rows
from tfpar.parallel.base import StrategyPlugin, parts_of, sum_parts
from tfpar.parallel.devices import data_parallel_devices


class ParallelDo(StrategyPlugin):
    """Split, run on every device, merge; one set of variables on ``variable_device``."""

    name = "parallel_do"
    replica_scope = "replica"  # ops of replica i are named <replica_scope>_<i>/...

    def __init__(self, device_names: list[str], variable_device: str = ""):
        self._devices = list(device_names)
        self.variable_device = variable_device or self._devices[0]

    @property
    def num_replicas(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> list[str]:
        return self._devices

    def scope(self):
        """Model and optimizer variables are created on the variable device."""
        return tf.device(self.variable_device)

    def distribute(self, dataset_fn):
        """Global batches: the step splits them itself."""
        return dataset_fn(None)

    def replicate(self, fn, batch, state):
        """Split and run: ``fn(rows, state rows)`` on each device (the backward ops of a
        tape built there land there too); each output leaf a ``Parts`` summed on the
        variable device."""
        with tf.device(self.variable_device), tf.name_scope("split"):
            shares = rows.split(batch, state, self.num_replicas)
        outs = []
        for i, (device, share) in enumerate(zip(self._devices, shares)):
            with tf.device(device), tf.name_scope(f"{self.replica_scope}_{i}"):
                outs.append(fn(share.batch, share.state))
        return parts_of(outs, self.variable_device, "sum", [s.size for s in shares])

    def sum_gradients(self, grads, variables, combine):
        """Merge: the sum of the replicas' gradients, on the variable device."""
        return sum_parts(grads, combine, "controller_reduce")

    def norm(self, grads, variables):
        with tf.device(self.variable_device), tf.name_scope("sum"):
            return tf.linalg.global_norm(grads)

    def run_update(self, optimizer, update, grads):
        """Once, on the variable device; the Keras optimizer, used outside any
        ``tf.distribute`` strategy, all-reduces nothing."""
        with tf.device(self.variable_device), tf.name_scope("update"):
            update(grads)


def build_parallel_do(dist: DistConfig, model: ModelConfig | None = None) -> ParallelDo:
    """On ``--devices``, all GPUs, or ``--cpu-devices`` logical CPUs (default 2)."""
    return ParallelDo(data_parallel_devices(dist))
