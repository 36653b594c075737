"""--precision mixed_bfloat16 / mixed_float16 (tfpar.model.precision).

What the policies promise: float32 variables, 16-bit compute in the embedding and the RNN
layers, float32 logits, loss and carried state; every strategy trains like ``default``
within the tolerance verify documents for the policy; with mixed_float16, dynamic loss
scaling whose skipped steps are neither applied nor counted as bad batches.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import model_config, small_config
from tfpar.config import resume_conflicts
from tfpar.model import precision
from tfpar.model.lm import build_model
from tfpar.objective import step
from tfpar.objective.output import output_loss
from tfpar.tools import verify
from tfpar.tools.cli import train_main

MIXED = ("mixed_bfloat16", "mixed_float16")


@pytest.mark.parametrize("policy", MIXED)
def test_a_mixed_policy_computes_in_16_bits_and_keeps_float32_where_promised(policy):
    config = model_config(embed_dim=8, hidden_dim=8, layers=2, precision=policy)
    model = build_model(config, 30)
    low = tf.as_dtype(policy.removeprefix("mixed_"))
    assert all(v.dtype == "float32" for v in model.weights)
    assert model.embedding.compute_dtype == low.name
    assert all(rnn.compute_dtype == low.name for rnn in model.rnns)
    ids = tf.constant([[3, 4, 5, 0], [6, 7, 0, 0]])
    x, _ = model.embed(ids)
    assert x.dtype == low
    logits, final = model(ids, initial_state=None)
    assert logits.dtype == tf.float32
    assert all(s.dtype == tf.float32 for layer in final for s in layer)
    # The large matmuls run in 16 bits: the traced step holds 16-bit MatMuls.
    graph = tf.function(lambda i: model(i)[0]).get_concrete_function(ids).graph
    matmul_types = {op.get_attr("T") for op in graph.get_operations()
                    if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3")}
    assert low in matmul_types, matmul_types
    # ... and the step differentiates a float32 loss.
    nll, count, _ = step.forward(model, {"inputs": ids, "targets": ids}, loss=output_loss(model.config))
    assert nll.dtype == tf.float32 and np.isfinite(float(nll))


# float16 with loss scaling under the tf.distribute path (Keras' optimizer applies per
# replica), bfloat16 under one of tfpar's own plug-ins; `verify_parallel.py --precision P
# --strategies default,mirrored:2,tower:3,pipeline:2` runs them all (README).
@pytest.mark.parametrize("policy, strategy", [
    ("mixed_bfloat16", ("pipeline", 2)),
    ("mixed_float16", ("mirrored", 2)),
])
def test_a_strategy_trains_like_default_within_the_policys_tolerance(policy, strategy):
    """verify's runners with the policy match default within verify's tolerance for it
    (the 16-bit matmuls themselves: test_a_mixed_policy_computes_in_16_bits...)."""
    spec = verify.VerifySpec(strategies=(strategy,), steps=4, precision=policy)
    assert (spec.tolerance, spec.eval_tolerance) == verify.TOLERANCES[policy]
    _, rows = verify.verify(spec)
    assert [(r.strategy, r.failures) for r in rows] == [(strategy[0], [])]
    assert rows[0].max_abs_param_diff > 0  # 16-bit rounding differs: the tolerance is used


def loss_scale_run(tmp_path, tiny_args, monkeypatch, initial_scale):
    """A tiny mixed_float16 run whose first steps overflow: the loss scale starts at
    ``initial_scale``; --on-nan stop, so one bad batch would end it with an error."""
    wrap = precision.with_loss_scaling

    def scaled(optimizer, policy):
        out = wrap(optimizer, policy)
        out.initial_scale = initial_scale
        return out

    monkeypatch.setattr(precision, "with_loss_scaling", scaled)
    from tfpar.training import schedule
    monkeypatch.setattr(schedule, "with_loss_scaling", scaled)
    code = train_main([*tiny_args, "--precision", "mixed_float16", "--on-nan", "stop",
                       "--no-export"])
    assert code == 0
    return json.loads((tmp_path / "metrics.json").read_text())


def test_loss_scale_skips_are_counted_and_never_stop_the_run(tmp_path, tiny_args,
                                                             monkeypatch):
    """A scale of 2**28 makes float16 gradients overflow: the run halves it step by step
    (each such step skipped, weights untouched), then trains its 6 steps; --on-nan stop
    is not tripped and no batch counts as bad."""
    metrics = loss_scale_run(tmp_path, tiny_args, monkeypatch, 2.0 ** 28)
    assert metrics["loss_scale_skips"] >= 3
    assert metrics["skipped_batches"] == 0
    assert metrics["steps"] == 6


def test_mixed_float16_checkpoints_do_not_resume_under_another_loss_scaling():
    fp16 = small_config(model=model_config(precision="mixed_float16"))
    for other in ("fp32", "mixed_bfloat16"):
        assert resume_conflicts(fp16, small_config(model=model_config(precision=other)))
    assert not resume_conflicts(small_config(), small_config(model=model_config(precision="mixed_bfloat16")))


def test_loss_scaling_divides_the_scaled_gradient_before_clipping():
    """One update with loss scaling equals the unscaled update: the clip factor comes from
    the true norm and the optimizer divides by the scale."""
    config = model_config(embed_dim=8, hidden_dim=8, layers=1)
    ids = tf.constant([[3, 4, 5, 6], [6, 7, 8, 0]])
    batch = {"inputs": ids, "targets": tf.roll(ids, 1, axis=1)}
    results = []
    for wrap in (False, True):
        model = build_model(config, 30, seed=1)
        optimizer = keras.optimizers.SGD(learning_rate=0.5)
        if wrap:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 10)
        optimizer.build(model.trainable_variables)
        scale = step.use_loss_scaling(model, optimizer)
        grads, nll, count, _ = step.replica_gradients(model, batch, tf.constant(7.0),
                                                      loss=output_loss(model.config))
        norm = tf.linalg.global_norm(grads)
        applied = step.update(norm, nll, 0.1, lambda f: optimizer.apply(
            [g * f for g in grads], model.trainable_variables), loss_scale=scale)
        assert bool(applied)
        results.append(([v.numpy() for v in model.trainable_variables],
                        float(norm) / (1.0 if scale is None else float(scale))))
    (plain, plain_norm), (scaled, scaled_norm) = results
    assert scaled_norm == pytest.approx(plain_norm, rel=1e-6)
    for a, b in zip(plain, scaled):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
