"""Dropout masks that are functions of (seed, step, site, row), never of the device.

Keras' ``Dropout`` draws from a stateful generator on each replica, so two replicas draw
different masks from one device's and the update of a run on N devices is not the update
of one device. Here every mask is a stateless Philox draw keyed by

    (model seed, optimizer step, site)   and, for per-sequence masks, the row's index in
                                          the *global* batch

so the rows a replica holds get exactly the masks one device gives those rows, a resumed
run draws the masks an uninterrupted one did (the step is checkpointed, there is no
generator state), and ``--deterministic`` runs repeat bit for bit.

Per-row masks: the global batch's rows ``0..R-1`` have a table ``u [R, T, D]`` (one
``[1, D]`` slice per row for locked masks) drawn with one op; a replica draws the
table's first ``max(rows) + 1`` rows and gathers its own. Philox is counter-based, so
row ``r`` of a table does not depend on how many rows it has (tests/test_noise.py checks
it). Shared masks (word types, recurrent weights) depend on (seed, step, site) only and
are the same on every replica.

Sites: 0 the embedding output, 1..L-1 between recurrent layers, L the last layer's
output, L+1 the word types, L+2+i the recurrent matrix of layer i.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

ALG = "philox"  # fixed, so CPUs, GPUs and TPUs draw the same masks


class Noise:
    """Draws the masks of one model.

    Args:
      seed: the model's seed.
      step: returns the current step (int scalar tensor); the train step sets it to the
        optimizer's iteration count (``tfpar.objective.step.key_noise_by_step``). Until then
        it is 0.
    """

    def __init__(self, seed: int, step: Callable[[], tf.Tensor] | None = None):
        self.seed = int(seed)
        self.step = step or (lambda: tf.constant(0, tf.int64))

    def key(self, site: int) -> tf.Tensor:
        """The [2] int64 Philox seed of ``site`` at the current step."""
        base = tf.constant([self.seed, site], tf.int64)
        return tf.random.experimental.stateless_fold_in(base, tf.cast(self.step(), tf.int64))

    def _keep(self, shape, rate: float, site: int) -> tf.Tensor:
        """Float32 mask of ``shape``: 1 / (1 - rate) with probability 1 - rate, else 0."""
        u = tf.random.stateless_uniform(shape, seed=self.key(site), alg=ALG)
        return tf.cast(u >= rate, tf.float32) / (1.0 - rate)

    def per_row(self, x: tf.Tensor, rate: float, site: int, rows: tf.Tensor, *,
                locked: bool) -> tf.Tensor:
        """Dropout on ``x`` [b, T, D] with each row's own mask.

        Args:
          rows: [b] int32, each row's index in the global batch.
          locked: one [D] mask per row for every time step (variational dropout);
            otherwise one per token.
        """
        if not rate:
            return x
        size = tf.shape(x)
        table = self._keep(tf.stack([tf.reduce_max(rows) + 1, 1 if locked else size[1],
                                     size[2]]), rate, site)
        return x * tf.cast(tf.gather(table, rows), x.dtype)

    def shared(self, shape, rate: float, site: int) -> tf.Tensor:
        """A mask of ``shape`` shared by every row and replica (word types, weights)."""
        return self._keep(shape, rate, site)


def global_rows(batch_rows: tf.Tensor, rows: tf.Tensor | None) -> tf.Tensor:
    """``rows`` [b] int32, or ``0..b-1`` when the batch is the whole global batch."""
    if rows is not None:
        return tf.cast(rows, tf.int32)
    return tf.range(batch_rows, dtype=tf.int32)
