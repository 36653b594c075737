"""The output layer's loss, an object handed to the step: the full softmax (fused, or from
the logits) or the sampled softmax.

The step (``tfpar.objective.step``) asks its loss for three things and reads no config:

* ``nll(model, x, targets)``: ``(nll_sum, count)`` of the full softmax over the
  vocabulary, what evaluation reports (and what the full softmax trains on);
* ``train_nll(model, x, targets)``: what training differentiates (the sampled softmax:
  its estimate, on candidates shared by the whole step);
* ``sparse_gradients``: whether gradients stay ``tf.IndexedSlices`` through the sum, the
  clip and the optimizer.

``x`` is the model's features [b, T, H] (``model.features``), ``targets`` [b, T] int32
with 0 for padding. :func:`output_loss` makes the configured one.
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.config import ModelConfig
from tfpar.objective import fused, losses, sampling

# The noise site (tfpar.model.noise) that keys the sampled softmax's candidates: one
# draw per (seed, step), the same on every replica and micro-batch.
CANDIDATE_SITE = -1


class FullSoftmax:
    """The full softmax: fused (``tfpar.objective.fused``: row and vocabulary blocks, no
    [rows, V] logits; ``blocks`` = (rows, columns), 0 = measured defaults) or, with
    ``fused`` False (``--no-fused-softmax``), from the logits."""

    sparse_gradients = False

    def __init__(self, *, fused: bool = True, blocks: tuple[int, int] = (0, 0)):
        self.fused = fused
        self.blocks = blocks

    def nll(self, model, x: tf.Tensor, targets: tf.Tensor, *, for_gradient: bool = False
            ) -> tuple[tf.Tensor, tf.Tensor]:
        """``(nll_sum, count)`` over the whole vocabulary; ``for_gradient``: the loss will
        be differentiated (the fused layer then computes its gradient in the same pass)."""
        if not self.fused:
            # Tokens flattened to [b*T, V] and [b*T]: on 3-D logits of unknown size TF adds
            # a run-time shape Assert, and a tf.function chains all its Asserts in program
            # order (automatic control dependencies), which would make the pipeline's
            # micro-batch j+1 wait for micro-batch j's logits.
            logits = model.softmax(x)
            return losses.nll_sum_and_count(tf.reshape(logits, [-1, tf.shape(logits)[-1]]),
                                            tf.reshape(targets, [-1]))
        layer = model.output_layer()
        rows, columns = self.blocks
        return fused.fused_softmax_nll(
            model.softmax_input(x), layer.kernel, layer.bias, targets,
            losses.token_mask(targets), vocab_major=layer.vocab_major,
            matmul_dtype=layer.matmul_dtype, rows=rows, columns=columns,
            gradient_in_forward=for_gradient)

    def train_nll(self, model, x: tf.Tensor, targets: tf.Tensor
                  ) -> tuple[tf.Tensor, tf.Tensor]:
        """``(nll_sum, count)`` that training differentiates."""
        return self.nll(model, x, targets, for_gradient=True)

    def token_nll(self, model, x: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
        """Each token's negative log-likelihood, [b, T] float32 (padding included: mask
        it)."""
        if not self.fused:
            return tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.cast(targets, tf.int32), logits=tf.cast(model.softmax(x), tf.float32))
        layer = model.output_layer()
        rows, columns = self.blocks
        nll = fused.token_nll(model.softmax_input(x), layer.kernel, layer.bias, targets,
                              vocab_major=layer.vocab_major, matmul_dtype=layer.matmul_dtype,
                              rows=rows, columns=columns)
        return tf.reshape(nll, tf.shape(targets))


class SampledSoftmax(FullSoftmax):
    """Trains on the sampled softmax (``num_sampled`` log-uniform candidates drawn from
    (seed, step), the same on every replica); evaluates on the full one. The embedding's
    and the softmax's gradients are ``tf.IndexedSlices`` (the rows a step touched)."""

    sparse_gradients = True

    def __init__(self, num_sampled: int, **full):
        super().__init__(**full)
        self.num_sampled = num_sampled

    def train_nll(self, model, x, targets):
        candidates = sampling.log_uniform_candidates(
            model.noise.key(CANDIDATE_SITE), self.num_sampled, model.vocab_size)
        weights, biases = model.softmax.output_weights()
        x = tf.cast(x, tf.float32)  # a mixed policy's 16-bit features: the loss is float32
        return losses.sampled_nll_sum_and_count(
            model.softmax.project(x), targets, _variable(weights), _variable(biases),
            candidates)


def _variable(weight):
    """The ``tf.Variable`` behind a Keras variable (gathered rows: a sparse read)."""
    return getattr(weight, "value", weight)


def output_loss(config: ModelConfig) -> FullSoftmax:
    """The loss ``config`` asks for (``softmax``, ``num_sampled``, ``fused_softmax``,
    ``softmax_blocks``)."""
    full = dict(fused=config.fused_softmax, blocks=config.softmax_block_sizes())
    if config.softmax == "sampled":
        return SampledSoftmax(config.num_sampled, **full)
    return FullSoftmax(**full)
