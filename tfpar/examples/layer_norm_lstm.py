"""A layer-normalised LSTM cell (after Ba, Kiros & Hinton 2016, section 3.1) for ``--cell``::

    tfpar-train --cell tfpar.examples.layer_norm_lstm:LayerNormLSTMCell --data ptb ...

The input's gate pre-activations are normalised, and so is the cell state before its
``tanh``. Ba et al. normalise the recurrent term ``h @ U`` too; measured here, that third
normalisation made a few SGD steps of a small model chaotic (initial weights moved by
1e-7 ended 6e-5 apart after verify_parallel's 10 steps, against 5e-7 without it), too
sensitive to rounding for any check of strategies against one device
(tfpar/docs/cells.md). tfpar wraps the cell in ``keras.layers.RNN`` (Keras' own loop).
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfpar_examples")
class LayerNormLSTMCell(keras.layers.Layer):
    """``call(x [B, D], [h [B, H], c [B, H]]) -> (h [B, H], [h, c])``, Keras' gate order
    (input, forget, cell, output)."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = [units, units]
        self.output_size = units
        self.norm_x = keras.layers.LayerNormalization(name="norm_x")
        self.norm_c = keras.layers.LayerNormalization(name="norm_c")

    def build(self, input_shape):
        gates = 4 * self.units
        self.kernel = self.add_weight(shape=(input_shape[-1], gates), name="kernel")
        self.recurrent_kernel = self.add_weight(shape=(self.units, gates),
                                                initializer="orthogonal",
                                                name="recurrent_kernel")
        self.bias = self.add_weight(shape=(gates,), initializer="zeros", name="bias")
        self.norm_x.build((None, gates))
        self.norm_c.build((None, self.units))

    def call(self, inputs, states):
        h, c = states
        z = (self.norm_x(ops.matmul(inputs, self.kernel))
             + ops.matmul(h, self.recurrent_kernel) + self.bias)
        i, f, g, o = ops.split(z, 4, axis=-1)
        c = ops.sigmoid(f) * c + ops.sigmoid(i) * ops.tanh(g)
        h = ops.sigmoid(o) * ops.tanh(self.norm_c(c))
        return h, [h, c]

    def get_config(self):
        return {**super().get_config(), "units": self.units}
