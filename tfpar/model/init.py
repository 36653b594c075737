"""Initial weights: each weight draws from its own stream, keyed by ``(seed, role)``.

Keras 3 documents that an initializer built with an integer seed returns the *same*
values on every call, and its unseeded initializers draw from one global generator in
the order variables happen to be created. The first made every matrix of the model begin
with the same numbers when one seeded initializer was shared (every LSTM kernel equal to
every other, the embedding's first values the softmax's); the second would tie a weight's
values to creation order, which a strategy's variable creator, a partitioner or a
pipeline's stage placement may change.

So every randomly initialised weight gets an initializer of its own whose integer seed is
derived from the run's ``--seed`` and the weight's *role* (``"embedding"``,
``"rnn_0/kernel"``, ``"softmax/projection"``, ...): the same weight gets the same values
under every strategy, on every device and in every process, and two weights never share
a stream. The draw is stateless (Keras' integer seed), so calling it again repeats it.
"""

from __future__ import annotations

import hashlib

import keras

def role_seed(seed: int, role: str) -> int:
    """A 31-bit seed for ``role``'s stream, a pure function of ``(seed, role)``."""
    digest = hashlib.sha256(f"{int(seed)}/{role}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def initializer(role: str, *, seed: int, scale: float, default: str):
    """The initializer of the weight ``role``.

    Args:
      role: what the weight is (``"rnn_0/recurrent_kernel"``), the key of its stream.
      seed: the run's seed.
      scale: ``--init-scale``: > 0, uniform in [-scale, scale]; 0, Keras' default for
        this kind of weight (``default``).
      default: ``"uniform"`` (an embedding's, [-0.05, 0.05]), ``"glorot_uniform"`` (a
        kernel's) or ``"orthogonal"`` (a recurrent kernel's).
    """
    s = role_seed(seed, role)
    if scale:
        return keras.initializers.RandomUniform(-scale, scale, seed=s)
    if default == "uniform":
        return keras.initializers.RandomUniform(-0.05, 0.05, seed=s)
    if default == "glorot_uniform":
        return keras.initializers.GlorotUniform(seed=s)
    if default == "orthogonal":
        return keras.initializers.Orthogonal(seed=s)
    raise ValueError(f"unknown default initializer {default!r}")


@keras.saving.register_keras_serializable(package="tfpar")
class ForgetGateBias(keras.initializers.Initializer):
    """An LSTM's bias [4H] in Keras' gate order (input, forget, cell, output): zeros, but
    ``value`` on the forget gate's H entries (``--forget-bias``).

    It is the bias's *initial* value, learned from there, not a constant added inside the
    cell (TF1's ``BasicLSTMCell(forget_bias=...)``): Keras' cuDNN path adds no constant,
    so a constant would make CPU and GPU compute different functions."""

    def __init__(self, value: float = 0.0):
        self.value = float(value)

    def __call__(self, shape, dtype=None):
        units = int(shape[-1]) // 4
        gates = [keras.ops.zeros((units,), dtype=dtype),
                 keras.ops.full((units,), self.value, dtype=dtype)]
        return keras.ops.concatenate(gates + [gates[0], gates[0]])

    def get_config(self):
        return {"value": self.value}
