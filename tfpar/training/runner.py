"""The runner: steps run over batches.

The step (``tfpar.objective.step``) computes one update; this module runs it:
:func:`make_train_steps`, up to N training steps in one ``tf.while_loop`` (every training
call; N = ``--steps-per-execution``, 1 by default), and :func:`run_steps`, the host loop
evaluation runs over a dataset, carrying the stream state from window to window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tfpar.objective import step
from tfpar.objective.output import output_loss
from tfpar.objective.step import StepOutput


def run_steps(step_fn, batches, *, stream: bool, initial_state=None):
    """Yields ``step_fn``'s output for each batch (evaluation's loop); in stream mode each
    window starts from the state the previous window ended in, the first from
    ``initial_state`` (None: zeros)."""
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


# What each step of a call reports, in StepOutput's fields (one transfer per call).
PER_STEP = {"nll_sum": tf.float32, "count": tf.float32, "grad_norm": tf.float32,
            "applied": tf.bool, "scale_skipped": tf.bool}


def make_train_steps(plugin, model, optimizer, *, clip_norm: float, loss=None):
    """``steps(iterator, state, n) -> CallOutput``: up to ``n`` updates in one
    ``tf.function`` call, with no host round trip between them: every training call of
    the synchronous loop (``n`` is 1 unless ``--steps-per-execution`` says more).

    A ``tf.while_loop`` reads the next batch of ``iterator`` (the plug-in's distributed
    iterator) with ``get_next_as_optional`` and runs the step's ``one_update`` on it,
    carrying the recurrent state from window to window in stream mode. It stops after
    ``n`` steps, when the iterator is exhausted, or right after a step whose update was
    not applied (so the loop handles that batch, and the state after it, before any later
    batch is consumed). Each step's loss, token count, gradient norm and outcome
    (``applied``, ``scale_skipped``) come back in one transfer at the end.

    Args:
      iterator: ``iter(plugin.distribute(...))``.
      state: stream mode: the state the first window starts from, in the plug-in's form
        (zeros at an epoch's start: one structure, so one graph serves every call);
        sentence mode: None.
      n: int32 scalar tensor, at most this many steps.

    ``loss``: as for ``tfpar.objective.step.make_train_step``.
    """
    one = step.one_update(plugin, model, optimizer, clip_norm=clip_norm,
                          loss=loss or output_loss(model.config))

    @tf.function(autograph=False)
    def train_steps(iterator, state, n):
        stream = state is not None
        carried = state if stream else tf.zeros([])
        arrays = [tf.TensorArray(dtype, size=n) for dtype in PER_STEP.values()]

        def cond(k, go, exhausted, carried, before, *arrays):
            return tf.logical_and(k < n, go)

        def body(k, go, exhausted, carried, before, *arrays):
            batch = iterator.get_next_as_optional()

            def run():
                out = one(batch.get_value(), carried if stream else None)
                new = _shaped_like(out.state, carried) if stream else carried
                return (k + 1, out.applied, tf.constant(False), new, carried,
                        *[a.write(k, getattr(out, key)) for a, key in zip(arrays, PER_STEP)])

            def stop():
                return (k, tf.constant(False), tf.constant(True), carried, before, *arrays)

            return tf.cond(batch.has_value(), run, stop)

        k, _, exhausted, carried, before, *arrays = tf.while_loop(
            cond, body, (tf.constant(0), tf.constant(True), tf.constant(False), carried,
                         carried, *arrays))
        return dict(**{key: a.stack()[:k] for key, a in zip(PER_STEP, arrays)},
                    exhausted=exhausted, state=carried if stream else None,
                    before=before if stream else None)

    def steps(iterator, state, n: int) -> CallOutput:
        out = train_steps(iterator, state, tf.constant(n, tf.int32))
        per_step = zip(*(out[key].numpy() for key in PER_STEP))
        return CallOutput([StepOutput(**dict(zip(PER_STEP, values))) for values in per_step],
                          out["state"], out["before"], bool(out["exhausted"]))

    steps.function = train_steps
    return steps


def _shaped_like(state, like):
    """``state`` with the static shapes of ``like`` (a loop variable must keep its shape;
    a plug-in that concatenates its final state from slices loses the static rows)."""
    return tf.nest.map_structure(
        lambda s, l: tf.ensure_shape(s, l.shape) if isinstance(s, tf.Tensor) else s,
        state, like)
