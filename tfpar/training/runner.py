"""The runner: a step run over batches, on the host or in one ``tf.function``.

The step (``tfpar.objective.step``) computes one update; this module runs it:
:func:`run_steps`, the host loop over a dataset that carries the stream state from
window to window, and :func:`make_train_steps`, up to N steps in one ``tf.while_loop``
(``--steps-per-execution``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tfpar.objective import step
from tfpar.objective.output import output_loss
from tfpar.objective.step import StepOutput


def run_steps(step_fn, batches, *, stream: bool, initial_state=None):
    """Yields ``step_fn``'s output for each batch; in stream mode each window starts from
    the state the previous window ended in (the one place that state is carried), the
    first from ``initial_state`` (None: zeros)."""
    state = initial_state if stream else None
    for batch in batches:
        out = step_fn(batch, state)
        state = out.state if stream else None
        yield out


@dataclasses.dataclass
class CallOutput:
    """What one call of :func:`make_train_steps`' function ran."""

    outputs: list  # a StepOutput per step run (state None), in order
    state: Any  # the state after the last one (stream mode; None in sentence mode)
    last_state_in: Any  # the state the last one started from (stream mode)
    exhausted: bool  # the iterator ran out (the epoch ended) inside this call


def make_train_steps(plugin, model, optimizer, *, clip_norm: float, loss=None):
    """``steps(iterator, state, n) -> CallOutput``: up to ``n`` updates in one
    ``tf.function`` call (``--steps-per-execution``), with no host round trip between them.

    A ``tf.while_loop`` reads the next batch of ``iterator`` (the plug-in's distributed
    iterator) with ``get_next_as_optional`` and runs the step's ``one_update`` on it,
    carrying the recurrent state from window to window in stream mode. It stops after
    ``n`` steps, when the iterator is exhausted, or right after a non-finite step (so the
    loop handles that batch exactly as with one step per call, and no later batch is
    consumed). Each step's loss, token count and gradient norm come back in one transfer
    at the end.

    Args:
      iterator: ``iter(plugin.distribute(...))``.
      state: stream mode: the state the first window starts from (not None; the loop
        runs a stream's first window with the one-step function); sentence mode: None.
      n: int32 scalar tensor, at most this many steps.

    ``loss``: as for ``tfpar.objective.step.make_train_step``.
    """
    one = step.one_update(plugin, model, optimizer, clip_norm=clip_norm,
                          loss=loss or output_loss(model.config))

    @tf.function(autograph=False)
    def train_steps(iterator, state, n):
        stream = state is not None
        carried = state if stream else tf.zeros([])
        arrays = [tf.TensorArray(tf.float32, size=n) for _ in range(3)]

        def cond(k, go, exhausted, carried, before, *arrays):
            return tf.logical_and(k < n, go)

        def body(k, go, exhausted, carried, before, *arrays):
            batch = iterator.get_next_as_optional()

            def run():
                agg = one(batch.get_value(), carried if stream else None)
                finite = tf.logical_and(tf.math.is_finite(agg.norm),
                                        tf.math.is_finite(agg.nll_sum))
                values = (agg.nll_sum, agg.count, agg.norm)
                new = _shaped_like(agg.state, carried) if stream else carried
                return (k + 1, finite, tf.constant(False), new, carried,
                        *[a.write(k, v) for a, v in zip(arrays, values)])

            def stop():
                return (k, tf.constant(False), tf.constant(True), carried, before, *arrays)

            return tf.cond(batch.has_value(), run, stop)

        k, _, exhausted, carried, before, *arrays = tf.while_loop(
            cond, body, (tf.constant(0), tf.constant(True), tf.constant(False), carried,
                         carried, *arrays))
        nll, count, norm = (a.stack()[:k] for a in arrays)
        return dict(nll_sum=nll, count=count, grad_norm=norm, exhausted=exhausted,
                    state=carried if stream else None, before=before if stream else None)

    def steps(iterator, state, n: int) -> CallOutput:
        out = train_steps(iterator, state, tf.constant(n, tf.int32))
        per_step = zip(*(out[key].numpy() for key in ("nll_sum", "count", "grad_norm")))
        return CallOutput([StepOutput(*values) for values in per_step], out["state"],
                          out["before"], bool(out["exhausted"]))

    steps.function = train_steps
    return steps


def _shaped_like(state, like):
    """``state`` with the static shapes of ``like`` (a loop variable must keep its shape;
    a plug-in that concatenates its final state from slices loses the static rows)."""
    return tf.nest.map_structure(
        lambda s, l: tf.ensure_shape(s, l.shape) if isinstance(s, tf.Tensor) else s,
        state, like)
