"""The fused output layer (tfpar.objective.fused) against the unfused path.

Tolerance: the two paths multiply the same numbers and differ only in the order their
float32 sums are taken (per block, XLA's fusions against TensorFlow's kernels, the
gradient scaled after its products instead of before). Each gradient element is a sum of
up to max(N, V) products; reassociating it moves the result by a few units of float32
rounding (2**-24 = 6e-8) of the largest terms, so elements are compared to 2e-6 of the
tensor's largest magnitude (the largest difference seen is 7e-7) and losses to 1e-6
relative.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import model_config, shared_data_dir
from tfpar.model import xla
from tfpar.model.lm import _matmul, build_model
from tfpar.objective import fused, step
from tfpar.objective.output import output_loss

GRAD_TOL = 2e-6
LOSS_TOL = 1e-6


# What the tests differentiate: the loss times a factor, as the step divides the summed
# loss by the token count (the fused gradient, computed with the loss, takes it after).
SCALE = 0.37


def unfused(h, kernel, bias, targets, weights, *, vocab_major=False, matmul_dtype=None):
    """The reference: the whole logits, TF's cross-entropy, the tape's gradient."""
    with tf.GradientTape() as tape:
        tape.watch([h, kernel, bias])
        logits = _matmul(h, kernel, matmul_dtype, transpose_b=vocab_major) + bias
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
        loss = tf.reduce_sum(nll * weights)
        scaled = loss * SCALE
    return loss, tape.gradient(scaled, [h, kernel, bias])


def fused_loss(h, kernel, bias, targets, weights, **kwargs):
    with tf.GradientTape() as tape:
        tape.watch([h, kernel, bias])
        loss, count = fused.fused_softmax_nll(h, kernel, bias, targets, weights, **kwargs)
        scaled = loss * SCALE
    tf.debugging.assert_equal(count, tf.reduce_sum(weights))
    return loss, tape.gradient(scaled, [h, kernel, bias])


def assert_close(got, want, grad_tol=GRAD_TOL):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(float(loss) / float(ref_loss) - 1) <= LOSS_TOL
    for name, g, r in zip(("dh", "dkernel", "dbias"), grads, ref_grads):
        scale = float(tf.reduce_max(tf.abs(r)))
        err = float(tf.reduce_max(tf.abs(g - r)))
        assert err <= grad_tol * scale, f"{name}: {err:.3g} > {grad_tol:g} x {scale:.3g}"


def random_batch(n=37, d=16, vocab=101, vocab_major=False, seed=0):
    """A batch with a third of its tokens masked (weight 0)."""
    gen = tf.random.Generator.from_seed(seed)
    h = gen.normal([n, d])
    kernel = gen.normal([vocab, d] if vocab_major else [d, vocab])
    bias = gen.normal([vocab])
    targets = gen.uniform([n], 0, vocab, dtype=tf.int32)
    weights = tf.cast(gen.uniform([n]) > 0.33, tf.float32)
    return h, kernel, bias, targets, weights


@pytest.mark.parametrize("vocab_major", [False, True], ids=["dense", "vocab_major"])
@pytest.mark.parametrize("blocks", [{}, {"rows": 10}, {"columns": 30}, {"rows": 8, "columns": 25}],
                         ids=["one_block", "row_blocks", "column_blocks", "both"])
@pytest.mark.parametrize("gradient_in_forward", [True, False], ids=["train", "eval"])
def test_loss_and_gradients_equal_the_unfused_path(vocab_major, blocks, gradient_in_forward):
    # V = 101 is no multiple of 30 or 25 (a last, narrower column block); N = 37 is no
    # multiple of 10 or 8 (padded rows).
    batch = random_batch(vocab_major=vocab_major)
    got = tf.function(lambda *b: fused_loss(*b, vocab_major=vocab_major,
                                            gradient_in_forward=gradient_in_forward,
                                            **blocks))(*batch)
    assert_close(got, unfused(*batch, vocab_major=vocab_major))


def test_masked_tokens_have_no_loss_and_no_gradient():
    h, kernel, bias, targets, weights = random_batch()
    loss, (dh, _, _) = fused_loss(h, kernel, bias, targets, weights, rows=8, columns=30)
    masked = weights.numpy() == 0
    assert masked.any() and not np.any(dh.numpy()[masked])
    # Other targets at the masked positions change nothing.
    moved = tf.where(weights > 0, targets, (targets + 7) % 101)
    assert fused_loss(h, kernel, bias, moved, weights, rows=8, columns=30)[0].numpy() == loss.numpy()


def test_per_token_nll_and_its_gradient():
    h, kernel, bias, targets, weights = random_batch()
    logits = tf.matmul(h, kernel) + bias
    want = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    got = fused.token_nll(h, kernel, bias, targets, rows=10, columns=30)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=LOSS_TOL, atol=0)
    # A weighted sum's gradient (weights of any sign) by recomputation.
    g = tf.random.stateless_normal([37], seed=[1, 2])
    with tf.GradientTape() as tape:
        tape.watch([h, kernel, bias])
        total = tf.reduce_sum(fused.token_nll(h, kernel, bias, targets, columns=30) * g)
        scaled = total * SCALE
    ref = unfused(h, kernel, bias, targets, g)
    assert_close((total, tape.gradient(scaled, [h, kernel, bias])), ref)


@pytest.mark.parametrize("blocks", [{}, {"rows": 8, "columns": 25}], ids=["one_block", "both"])
def test_bf16_products_float32_everything_else(blocks):
    """The products take bfloat16 inputs and round their results to bfloat16, as the
    unfused --precision bf16 path's; the log-sum-exp, the loss and the sums of blocks
    are float32. So the loss (every logit the same product over D, whatever the blocks)
    equals the unfused one to float32 rounding. The gradients round other tensors than
    the unfused path's (the exponentials before the row's factor; each block's products),
    so each is compared with the float64 gradient of the same loss: the bf16 logits put
    both paths about 1e-2 of the largest element away from it (the unfused path's own
    error, measured 4e-3 to 1.2e-2), within 2**-6."""
    batch = random_batch(vocab_major=True)
    got = fused_loss(*batch, vocab_major=True, matmul_dtype="bfloat16", **blocks)
    want = unfused(*batch, vocab_major=True, matmul_dtype="bfloat16")
    exact = unfused(*[tf.cast(x, tf.float64) if x.dtype == tf.float32 else x for x in batch],
                    vocab_major=True)
    assert abs(float(got[0]) / float(want[0]) - 1) <= LOSS_TOL
    for name, g, u, x in zip(("dh", "dkernel", "dbias"), got[1], want[1], exact[1]):
        assert g.dtype == tf.float32
        scale = float(tf.reduce_max(tf.abs(x)))
        fused_err, unfused_err = (float(tf.reduce_max(tf.abs(tf.cast(a, tf.float64) - x)))
                                  for a in (g, u))
        assert fused_err <= 2 ** -6 * scale and unfused_err <= 2 ** -6 * scale, name
    # Float32 products are 1e-6 away; these are bfloat16's.
    assert float(tf.reduce_max(tf.abs(tf.cast(got[1][1], tf.float64) - exact[1][1]))) > 1e-4


def test_float16_products_with_more_words_than_float16_counts():
    """70,000 near-uniform words in one block: a row's sum of exponentials passes
    float16's largest number, which the gradient's 16-bit inputs must never hold."""
    batch = random_batch(4, 8, 70_000)
    batch = (batch[0] * 0.01,) + batch[1:]  # logits near 0: the sum is near V
    got = fused_loss(*batch, matmul_dtype="float16")
    want = unfused(*batch)
    assert all(np.isfinite(g.numpy()).all() for g in got[1])
    assert_close(got, want, grad_tol=2 ** -9)


def test_a_huge_vocabulary_in_many_blocks_matches_float64():
    """793,471 words in column blocks (49 of 16,194): the online log-sum-exp stays within
    float32 rounding of the float64 result."""
    n, d, vocab = 6, 16, 793_471
    h, kernel, bias, targets, _ = random_batch(n, d, vocab)
    got = fused.token_nll(h, kernel, bias, targets, columns=16384).numpy()
    logits = np.float64(h.numpy()) @ np.float64(kernel.numpy()) + np.float64(bias.numpy())
    top = logits.max(1)
    want = top + np.log(np.exp(logits - top[:, None]).sum(1)) - logits[np.arange(n), targets]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_the_same_bits_every_run():
    batch = random_batch()
    run = tf.function(lambda *b: fused_loss(*b, rows=8, columns=25))
    first, second = run(*batch), run(*batch)
    for a, b in zip(tf.nest.flatten(first), tf.nest.flatten(second)):
        assert np.array_equal(a.numpy(), b.numpy())


def test_evaluation_never_holds_a_rows_by_vocabulary_tensor():
    """Every tensor of the blocked evaluation (its loops' bodies included) has a known
    shape and none is larger than the weight matrix or one block of logits."""
    n, d, vocab, columns = 64, 8, 5000, 512
    h, kernel, bias, targets, _ = random_batch(n, d, vocab)
    graph = tf.function(lambda h: fused.token_nll(h, kernel, bias, targets, columns=columns)
                        ).get_concrete_function(h).graph
    sizes = [t.shape.num_elements() for op in _all_ops(graph) for t in op.outputs
             if not op.name.startswith("while/") or op.type != "Placeholder"]
    assert None not in sizes
    assert max(sizes) <= max(d * vocab, n * columns) < n * vocab


def _all_ops(graph):
    """``graph``'s operations and those of the functions it calls (loop bodies)."""
    for op in graph.get_operations():
        yield op
        for attr in ("body", "cond", "then_branch", "else_branch", "f"):
            try:
                name = op.get_attr(attr).name
            except (ValueError, TypeError, AttributeError):
                continue
            function = graph._get_function(name)
            if function is not None:
                yield from _all_ops(function.graph)


# -- the model's loss: fused and unfused on one real batch
def ptb_batch(rows=20, steps=35):
    """PTB's valid split from its start as 20 x 35 windows, ids of train's 10k words
    (10,001 with padding), the last five targets padding."""
    from tfpar.data.vocab import Vocab

    folder = os.path.join(shared_data_dir(), "ptb")
    if not os.path.isfile(os.path.join(folder, "ptb.train.txt")):
        pytest.skip(f"PTB is not at {folder} (tfpar-download ptb puts it there)")
    with open(os.path.join(folder, "ptb.train.txt"), encoding="utf-8") as f:
        vocab = Vocab.build(f.read().splitlines())
    with open(os.path.join(folder, "ptb.valid.txt"), encoding="utf-8") as f:
        ids = [i for line in f.read().splitlines()[:200] for i in vocab.encode(line) + [2]]
    ids = np.array(ids[: rows * steps + 1], np.int32)
    inputs, targets = ids[:-1].reshape(rows, steps), ids[1:].reshape(rows, steps)
    targets[-1, -5:] = 0  # padding
    return {"inputs": tf.constant(inputs), "targets": tf.constant(targets)}, len(vocab)


# The model's gradients compare to 1e-5 of each variable's largest element: the softmax
# bias's gradient sums 700 rows, and the unfused path's own (TensorFlow's bias-add
# gradient) is 6.5e-6 of its largest element away from the float64 result, the fused
# one's 9.6e-7. With bf16 products every gradient of the logits is rounded to bfloat16
# before its products, so a last-bit float32 difference can move an element by a
# bfloat16 unit (2**-8), which the recurrence's products carry on (8e-3 seen): those
# compare to 2**-6, the loss and the bias (float32 throughout) as in float32.
MODEL_TOL = {"fp32": 1e-5, "bf16": 2 ** -6}


@pytest.mark.parametrize("model", [
    dict(embed_dim=64, hidden_dim=64),
    dict(embed_dim=32, hidden_dim=64, tie_embeddings=True),  # tied, with the projection
    dict(embed_dim=64, hidden_dim=64, precision="bf16"),
], ids=["dense", "tied_projection", "bf16"])
def test_the_models_gradients_equal_the_unfused_path_on_a_ptb_batch(model):
    batch, vocab_size = ptb_batch()
    config = model_config(layers=1, **model)
    models = [build_model(dataclasses.replace(config, fused_softmax=f), vocab_size, seed=3)
              for f in (True, False)]
    count = tf.constant(float(np.sum(batch["targets"].numpy() != 0)))
    (got, nll, n, _), (want, ref_nll, ref_n, _) = (
        tf.function(lambda b: step.replica_gradients(m, b, count, loss=output_loss(m.config)))(batch) for m in models)
    assert n.numpy() == ref_n.numpy() == count.numpy()
    assert abs(nll.numpy() / ref_nll.numpy() - 1) <= LOSS_TOL
    for v, g, r in zip(models[0].trainable_variables, got, want):
        tol = MODEL_TOL["fp32" if v.path == "rnn_lm/softmax/bias" else config.precision]
        err, scale = np.max(np.abs(g.numpy() - r.numpy())), np.max(np.abs(r.numpy()))
        assert err <= tol * scale, f"{v.path}: {err:.3g} > {tol:g} x {scale:.3g}"


@pytest.mark.parametrize("n", [8, 21], ids=["fits_one_block", "needs_row_blocks"])
def test_a_row_count_the_trace_hides_takes_the_path_of_the_actual_count(n):
    """A strategy's slice of the batch and a batch read inside a multi-step loop have no
    static row count; the path must follow the count the step runs with: the same bits
    as a trace that sees it (the one-block path when the rows fit, row blocks when they
    do not), and equal to the unfused path."""
    batch = random_batch(n=n)
    h, kernel, bias, targets, weights = batch
    hidden = [tf.TensorSpec([None, h.shape[1]]), tf.TensorSpec(kernel.shape),
              tf.TensorSpec(bias.shape), tf.TensorSpec([None], tf.int32),
              tf.TensorSpec([None])]
    with xla.compile_any_shape():  # the step's parts run XLA-compiled either way
        seen = tf.function(lambda *a: fused_loss(*a, rows=10))(*batch)
        got = tf.function(lambda *a: fused_loss(*a, rows=10), input_signature=hidden)(*batch)
    assert_close(got, unfused(*batch))
    assert float(got[0]) == float(seen[0])
    for g, s in zip(got[1], seen[1]):
        np.testing.assert_array_equal(g.numpy(), s.numpy())
