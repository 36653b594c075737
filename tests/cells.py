"""Cells for the tests of ``--cell MODULE:NAME`` (tests/test_cells.py): a good one with
three state tensors of unequal widths, and one of each kind of mistake. Importable as
``cells`` with tests/ on the path (the subprocess tests put it on PYTHONPATH)."""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

WIDTHS = (5, 7, 3)  # none equal to the tests' hidden sizes (8, 16)


class ThreeStateCell(keras.layers.Layer):
    """``call(x [B, D], [a [B, 5], b [B, 7], c [B, 3]]) -> (y [B, H], [a', b', c'])``:
    every new tensor a function of the input and of all three old ones."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = list(WIDTHS)
        self.output_size = units

    def build(self, input_shape):
        width = sum(WIDTHS) + self.units
        self.kernel = self.add_weight(shape=(input_shape[-1] + sum(WIDTHS), width),
                                      name="kernel")
        self.bias = self.add_weight(shape=(width,), initializer="zeros", name="bias")

    def call(self, inputs, states):
        z = ops.tanh(ops.matmul(ops.concatenate([inputs, *states], axis=-1), self.kernel)
                     + self.bias)
        cuts = list(ops.split(z, [WIDTHS[0], WIDTHS[0] + WIDTHS[1], sum(WIDTHS)], axis=-1))
        return cuts[3], [cuts[0], cuts[1] * states[1] + cuts[1], cuts[2]]


def three_state(units):
    """A factory, not a class: tfpar calls it with the hidden size."""
    return ThreeStateCell(units)


class SeededCell(ThreeStateCell):
    """Its kernel's initializer carries its own seed: tfpar keeps it."""

    def build(self, input_shape):
        width = sum(WIDTHS) + self.units
        self.kernel = self.add_weight(
            shape=(input_shape[-1] + sum(WIDTHS), width), name="kernel",
            initializer=keras.initializers.RandomNormal(stddev=0.3, seed=1234))
        self.bias = self.add_weight(shape=(width,), initializer="zeros", name="bias")


NOT_A_CELL = 42


def dense(units):
    """A layer, but no RNN cell (no state_size)."""
    return keras.layers.Dense(units)


class NestedStateCell(ThreeStateCell):
    """A state_size the carry cannot hold: nested."""

    def __init__(self, units, **kwargs):
        super().__init__(units, **kwargs)
        self.state_size = [[5, 7], 3]


class WideCell(ThreeStateCell):
    """Its output is one wider than the hidden size."""

    def __init__(self, units, **kwargs):
        super().__init__(units, **kwargs)
        self.output_size = units + 1


class LyingCell(ThreeStateCell):
    """Says its output is the hidden size, returns one more column."""

    def call(self, inputs, states):
        out, new = super().call(inputs, states)
        return ops.concatenate([out, out[:, :1]], axis=-1), new


class UnusedWeightCell(ThreeStateCell):
    """A trainable weight its step never reads."""

    def build(self, input_shape):
        super().build(input_shape)
        self.spare = self.add_weight(shape=(4,), name="spare")


class FailingCell(ThreeStateCell):
    """A step with a shape mistake."""

    def call(self, inputs, states):
        return ops.matmul(inputs, self.kernel), states


class PythonCell(ThreeStateCell):
    """Calls back into Python at every step (tf.numpy_function, off the gradient's path):
    it trains, but a SavedModel cannot serve it without this process."""

    def call(self, inputs, states):
        out, new = super().call(inputs, states)
        one = tf.numpy_function(lambda: np.float32(1.0), [], tf.float32, stateful=False)
        return out * tf.stop_gradient(tf.reshape(one, [])), new
