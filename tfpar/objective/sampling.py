"""Sampled-softmax candidates: log-uniform, unique, the same on every replica.

``tf.nn.sampled_softmax_loss`` draws its candidates with
``tf.random.log_uniform_candidate_sampler``, a stateful op: every replica (every copy of
the op) would draw its own, and a resumed run would not draw what an uninterrupted one
did. Here the draw is a function of a Philox key, ``(model seed, optimizer step)``, so
every replica of a step, and every micro-batch of a pipeline, computes the same candidates
from the same key, shared across the whole global batch (Jozefowicz et al. 2016), and N
devices give one device's update.

The sampler is TensorFlow's ``LogUniformSampler`` with ``unique=True``, reproduced in
stateless ops (``tensorflow/core/kernels/range_sampler.cc``)::

    draw     d_i = floor(exp(u_i * log(V + 1))) - 1,  u_i ~ U[0, 1) (float64)
             P(d = k) = log((k + 2) / (k + 1)) / log(V + 1)   (Zipf-like: id 0 most likely)
    unique   draw until K distinct ids are seen; ``tries`` = the draws that took
    expected count of id k (what the loss subtracts, as log Q):
             tries == K:  K * P(k);   else  1 - (1 - P(k)) ** tries

The ids are vocabulary ids, which tfpar orders by falling train frequency after the
three specials (``tfpar.data.vocab``), the order a log-uniform sampler assumes.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfpar.model.noise import ALG


@dataclasses.dataclass
class Candidates:
    """One step's shared candidates."""

    ids: tf.Tensor  # [K] int64, distinct, in the order they were first drawn
    tries: tf.Tensor  # int64 scalar: draws it took to see K distinct ids
    num_sampled: int  # K
    range_max: int  # V: ids are in [0, V)

    def expected_count(self, classes: tf.Tensor) -> tf.Tensor:
        """How often ``classes`` (any shape, int) are expected among the draws
        (``sampled_softmax_loss``'s ``true_expected_count`` / ``sampled_expected_count``),
        float32 of the same shape."""
        p = log_uniform_probability(classes, self.range_max)
        tries = tf.cast(self.tries, tf.float64)
        unique = -tf.math.expm1(tries * tf.math.log1p(-p))
        count = tf.where(tf.equal(self.tries, self.num_sampled), p * self.num_sampled, unique)
        return tf.cast(count, tf.float32)

    def sampled_values(self, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """``sampled_softmax_loss``'s ``sampled_values`` for ``labels`` [N, 1] int64:
        ``(ids [K], true expected counts [N, 1], sampled expected counts [K])``, the
        triple ``tf.random.log_uniform_candidate_sampler`` returns."""
        return (self.ids, self.expected_count(labels), self.expected_count(self.ids))


def log_uniform_probability(classes: tf.Tensor, range_max: int) -> tf.Tensor:
    """``P(k) = log((k + 2) / (k + 1)) / log(V + 1)``, float64 of ``classes``' shape."""
    k = tf.cast(classes, tf.float64)
    return tf.math.log((k + 2.0) / (k + 1.0)) / tf.math.log1p(tf.cast(range_max, tf.float64))


def _draw(key: tf.Tensor, size: tf.Tensor, range_max: int) -> tf.Tensor:
    """The first ``size`` draws of the key's sequence: log-uniform ids in [0, V), int64.
    Philox is counter-based, so a longer draw starts with a shorter one."""
    u = tf.random.stateless_uniform(tf.reshape(size, [1]), seed=key, dtype=tf.float64, alg=ALG)
    ids = tf.cast(tf.floor(tf.exp(u * tf.math.log1p(tf.cast(range_max, tf.float64)))),
                  tf.int64) - 1
    return tf.clip_by_value(ids, 0, range_max - 1)


def _distinct(draws: tf.Tensor) -> tf.Tensor:
    return tf.shape(tf.unique(draws).y, out_type=tf.int64)[0]


def log_uniform_candidates(key: tf.Tensor, num_sampled: int, range_max: int) -> Candidates:
    """``num_sampled`` distinct log-uniform ids in ``[0, range_max)``, a pure function of
    ``key`` (see the module docstring).

    Args:
      key: [2] int64 Philox seed (``tfpar.model.noise.Noise.key``).
      num_sampled: K, 1 <= K < range_max.
      range_max: V, the vocabulary size.

    Returns:
      :class:`Candidates` with ``ids`` [K] int64.
    """
    if not 1 <= num_sampled < range_max:
        raise ValueError(f"num_sampled {num_sampled} must be in [1, {range_max})")
    # How many draws to look at: 2K + 64 usually suffices (K = 8192 of V = 793,471 takes
    # ~16,000 draws); doubled until K distinct ids are among them (K near V takes many).
    (size,) = tf.while_loop(
        lambda n: _distinct(_draw(key, n, range_max)) < num_sampled, lambda n: (2 * n,),
        (tf.constant(2 * num_sampled + 64, tf.int64),))
    draws = _draw(key, size, range_max)  # [size], its static length unknown
    # tf.unique lists ids in the order they first occur; the K-th one ends the tries.
    unique, index = tf.unique(draws, out_idx=tf.int64)
    positions = tf.range(tf.shape(draws, out_type=tf.int64)[0])
    first_seen = tf.math.unsorted_segment_min(positions, index,
                                              tf.shape(unique, out_type=tf.int64)[0])
    return Candidates(tf.ensure_shape(unique[:num_sampled], [num_sampled]),
                      first_seen[num_sampled - 1] + 1, num_sampled, range_max)
