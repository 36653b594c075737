"""Numeric precision: ``--precision fp32 | bf16 | mixed_bfloat16 | mixed_float16``.

* ``fp32``: everything in float32.
* ``bf16``: float32 layers whose large matmuls (the RNN input projections and their weight
  gradients, the softmax) take bfloat16 inputs; for CPUs with AMX/AVX512-BF16.
* ``mixed_bfloat16`` / ``mixed_float16``: Keras mixed-precision dtype policies
  (``keras.DTypePolicy``): every variable float32, the embedding and the RNN layers
  compute in the 16-bit type. The softmax layer keeps float32 output: its product runs
  with 16-bit inputs and the logits, log-softmax and loss are float32. On a GPU the RNN
  layers call cuDNN with 16-bit tensors (float16 computes in float16; TensorFlow's
  bfloat16 cuDNN kernel casts to float32 inside, so mixed_float16 is the policy for RNNs
  on GPUs); on a CPU their fast recurrence keeps its state
  and gate arithmetic in float32 around 16-bit matmuls (``tfpar.model.layers``), and the
  recurrent state carried between stream windows is float32 everywhere.
  ``mixed_float16`` adds dynamic loss scaling (``keras.optimizers.LossScaleOptimizer``):
  the loss is multiplied by the scale before differentiating, the summed gradient is
  divided by it before the norm, clipping and the update (``tfpar.objective.step``); a
  step whose scaled gradient overflows is skipped and halves the scale, and 2,000
  finite steps in a row double it. Such a skip is part of loss scaling, not a bad batch:
  the loop counts it apart and it never trips ``--on-nan`` or ``--nan-patience``.
"""

from __future__ import annotations

import keras

from tfpar.config import MIXED_PRECISIONS as MIXED


def dtype_policy(precision: str) -> keras.DTypePolicy | None:
    """The Keras policy of the embedding and RNN layers (None: float32 layers)."""
    return keras.DTypePolicy(precision) if precision in MIXED else None


def matmul_dtype(precision: str) -> str | None:
    """The input type of the large matmuls of float32-output layers (None: float32)."""
    if precision == "bf16":
        return "bfloat16"
    policy = dtype_policy(precision)
    return None if policy is None else policy.compute_dtype


def loss_scaled(precision: str) -> bool:
    """Whether training scales its loss (float16's narrow exponent range needs it)."""
    return precision == "mixed_float16"


def with_loss_scaling(optimizer: keras.optimizers.Optimizer, precision: str):
    """``optimizer`` wrapped in Keras' ``LossScaleOptimizer`` when ``precision`` scales
    its loss (Keras' defaults: initial scale 2**15, doubled after 2,000 finite steps)."""
    if not loss_scaled(precision):
        return optimizer
    return keras.optimizers.LossScaleOptimizer(optimizer)


def loss_scale(optimizer):
    """The current loss scale (a float32 variable) of a ``LossScaleOptimizer``, or None."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale
    return None
