"""XLA where it helps, and only there: fixed-shape parts of a traced step.

On CPUs, XLA removes TF's per-op overhead from small ops repeated many times (the RNN
recurrences) and fuses the cross-entropy's passes over the [N, V] logits. It compiles once
per input shape, so it is only worth it when the shape is fixed: stream mode's windows, and
the first trace of a step. Sentence mode's buckets are traced with unknown dimensions and
run TF's kernels, so XLA never compiles per bucket.
"""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf

# Set while tracing a train step whose inputs have few shapes at run time, which the
# trace may not see (stream mode's windows, sliced by a strategy or read inside a
# multi-step loop): XLA then compiles per run-time shape, so a step runs the same kernels
# however it was traced. A module global, not a thread-local: MirroredStrategy traces its
# replicas on threads of its own.
_ANY_SHAPE = False


@contextlib.contextmanager
def compile_any_shape():
    """Within: :func:`when_shapes_fixed` functions traced with unknown dimensions still
    run XLA-compiled (one compilation per run-time shape)."""
    global _ANY_SHAPE
    before, _ANY_SHAPE = _ANY_SHAPE, True
    try:
        yield
    finally:
        _ANY_SHAPE = before


def when_shapes_fixed(fn):
    """Wraps ``fn`` (tensor arguments, or None) to run XLA-compiled when it is called while
    tracing a graph with fully known argument shapes, and as plain TF ops otherwise
    (eagerly, or with an unknown dimension). Both compute the same math; XLA's fused
    kernels may round differently in the last bits."""
    compiled = tf.function(fn, jit_compile=True, autograph=False)

    @functools.wraps(fn)
    def call(*args):
        fixed = _ANY_SHAPE or all(
            a is None or (isinstance(a, tf.Tensor) and a.shape.is_fully_defined())
            for a in args)
        if fixed and not tf.executing_eagerly():
            return compiled(*args)
        return fn(*args)

    call.compiled = compiled
    return call
