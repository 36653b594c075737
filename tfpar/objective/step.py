"""The per-replica step math every strategy shares.

A strategy decides *where* these run and *how* their results are combined; what a
replica computes is only here. One replica's gradient is the gradient of
``nll_sum / global_token_count`` on its rows, so the sum of the replicas' gradients is the
gradient a single device computes on the whole global batch, however unevenly the tokens
are spread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tfpar.objective import losses


@dataclasses.dataclass
class StepOutput:
    """What a train or eval step reports (scalars already summed over replicas)."""

    nll_sum: tf.Tensor
    count: tf.Tensor
    grad_norm: tf.Tensor | None = None
    # The recurrent state to feed to the next window (stream mode), in the strategy's own
    # form (a tensor structure, or per-replica values); None in sentence mode.
    state: Any = None


def as_step_output(step_fn):
    """Wraps a ``tf.function`` that returns a dict of StepOutput fields (tf.function cannot
    return a dataclass) so callers get a :class:`StepOutput`. The wrapped function stays
    reachable as ``.function`` (graph inspection in tests)."""

    def step(batch, state=None):
        return StepOutput(**step_fn(batch, state))

    step.function = step_fn
    return step


def forward(model, batch: dict, state=None, training: bool = False):
    """Runs the model on one batch.

    Returns:
      ``(nll_sum, count, final_state)``; ``final_state`` is None when ``state`` is None
      and the model is not asked to carry it.
    """
    logits, final = model(batch["inputs"], initial_state=state, training=training)
    nll_sum, count = losses.nll_sum_and_count(logits, batch["targets"])
    return nll_sum, count, final


def loss_and_grads(model, batch: dict, global_count: tf.Tensor, state=None,
                   training: bool = True):
    """Gradients of ``nll_sum / global_count`` on this replica's rows.

    Args:
      model: the Keras model.
      batch: {"inputs": [b, T], "targets": [b, T]}, this replica's rows.
      global_count: real target tokens in the whole global batch (all replicas).
      state: initial recurrent state or None.
      training: dropout on.

    Returns:
      ``(grads, nll_sum, count, final_state)``.
    """
    with tf.GradientTape() as tape:
        nll_sum, count, final = forward(model, batch, state, training)
        loss = nll_sum / tf.maximum(global_count, 1.0)
    grads = tape.gradient(loss, model.trainable_variables)
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    return grads, nll_sum, count, final


def clip_factor(global_norm: tf.Tensor, clip_norm: float) -> tf.Tensor:
    """The factor ``tf.clip_by_global_norm`` would apply: ``c / max(norm, c)`` (1 if c=0)."""
    if not clip_norm:
        return tf.constant(1.0)
    return clip_norm / tf.maximum(global_norm, clip_norm)


def detach_state(state):
    """Stops gradients flowing into the previous window (truncated BPTT)."""
    return tf.nest.map_structure(tf.stop_gradient, state)


def apply_if_finite(optimizer, grads, variables, global_norm: tf.Tensor) -> None:
    """Applies ``grads`` unless ``global_norm`` is inf/NaN (for plug-ins that aggregate
    gradients themselves, outside any ``tf.distribute`` replica context)."""

    def apply():
        optimizer.apply_gradients(zip(grads, variables))
        return tf.constant(True)

    tf.cond(tf.math.is_finite(global_norm), apply, lambda: tf.constant(False))
