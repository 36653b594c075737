"""--softmax sampled: the shared log-uniform candidates, the token-weighted sampled loss,
and gradients that stay tf.IndexedSlices from the tape to the optimizer (only the rows a
step touched change), under one device and mirrored."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import batch_of, model_config
from tfpar.config import DistConfig
from tfpar.parallel.rows import per_replica
from tfpar.errors import ConfigError
from tfpar.model.lm import build_model
from tfpar.model.noise import Noise
from tfpar.objective import losses, output, sampling, step
from tfpar.objective.output import output_loss
from tfpar.parallel.registry import build_strategy
from tfpar.objective.step import make_train_step

KEY = tf.constant([3, 7], tf.int64)
V = 60


# ------------------------------------------------------------------ the candidates
def test_candidates_are_distinct_in_range_and_a_function_of_the_key():
    c = sampling.log_uniform_candidates(KEY, 20, V)
    ids = c.ids.numpy()
    assert ids.shape == (20,) and ids.dtype == np.int64
    assert len(set(ids.tolist())) == 20 and ids.min() >= 0 and ids.max() < V
    assert int(c.tries) >= 20
    again = sampling.log_uniform_candidates(KEY, 20, V)
    np.testing.assert_array_equal(again.ids.numpy(), ids)
    assert int(again.tries) == int(c.tries)
    other = sampling.log_uniform_candidates(tf.random.experimental.stateless_fold_in(KEY, 1),
                                            20, V)
    assert other.ids.numpy().tolist() != ids.tolist()
    # On another device, in a graph: the same draw (what makes replicas agree).
    with tf.device("/device:CPU:1"):
        traced = tf.function(lambda k: sampling.log_uniform_candidates(k, 20, V).ids)(KEY)
    np.testing.assert_array_equal(traced.numpy(), ids)


def test_more_chunks_are_drawn_until_k_distinct_ids_are_seen():
    """K close to V needs many more draws than one chunk of 2K + 64 holds."""
    c = sampling.log_uniform_candidates(KEY, 58, V)
    assert sorted(c.ids.numpy().tolist()) == sorted(set(c.ids.numpy().tolist()))
    assert len(c.ids.numpy()) == 58 and int(c.tries) > 2 * 58 + 64


def test_probabilities_are_tensorflows_log_uniform_sampler():
    """P(k) as TF's LogUniformSampler gives it: with unique=False and one draw, the
    expected count of a class is its probability."""
    classes = tf.constant([[0], [1], [2], [10], [59]], tf.int64)
    _, want, _ = tf.random.log_uniform_candidate_sampler(
        classes, num_true=1, num_sampled=1, unique=False, range_max=V)
    got = sampling.log_uniform_probability(classes, V)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    assert float(tf.reduce_sum(sampling.log_uniform_probability(tf.range(V), V))) == \
        pytest.approx(1.0, rel=1e-9)


def test_candidates_are_drawn_as_tensorflows_unique_sampler_draws_them():
    """Over many draws, how often each class is among the K candidates: the same for
    this sampler (over keys) as for tf.random.log_uniform_candidate_sampler (stateful)."""
    k, runs = 12, 1000

    @tf.function
    def ours(i):
        return sampling.log_uniform_candidates(
            tf.stack([tf.constant(5, tf.int64), i]), k, V).ids

    @tf.function
    def theirs():
        return tf.random.log_uniform_candidate_sampler(
            tf.zeros([1, 1], tf.int64), 1, k, True, V)[0]

    mine, tfs = np.zeros(V), np.zeros(V)
    for i in range(runs):
        mine[ours(tf.constant(i, tf.int64)).numpy()] += 1
        tfs[theirs().numpy()] += 1
    # Two Bernoulli frequencies of 1000 runs: the difference's standard error <= 0.023.
    np.testing.assert_allclose(mine / runs, tfs / runs, atol=0.1)
    assert mine[0] / runs > 0.85 and mine[V - 1] / runs < 0.15  # log-uniform: head first


def test_expected_counts_are_tensorflows_for_the_same_tries():
    """TF's unique sampler reports 1 - (1 - P(k))^tries for its candidates and the true
    classes; with its tries (read back from one of its counts) ours are the same."""
    labels = tf.constant([[0], [3], [17], [59]], tf.int64)
    ids, true_count, sampled_count = tf.random.log_uniform_candidate_sampler(
        labels, 1, 30, True, V, seed=1)  # 30 of 60: repeats, tries > K
    p = sampling.log_uniform_probability(ids, V).numpy()
    count = sampled_count.numpy().astype(np.float64)
    tries = np.log1p(-count) / np.log1p(-p)
    n = int(round(float(np.median(tries))))
    # Inverting a float32 count near 1 (a frequent id: 1 - (1 - P)^n rounds up) loses the
    # digits; the other counts each give the tries back.
    assert n > 30 and np.allclose(tries[count < 0.99], n, rtol=1e-3)
    c = sampling.Candidates(ids, tf.constant(n, tf.int64), 30, V)
    np.testing.assert_allclose(c.expected_count(ids).numpy(), sampled_count.numpy(), rtol=1e-5)
    np.testing.assert_allclose(c.expected_count(labels).numpy(), true_count.numpy(), rtol=1e-5)
    exact = sampling.Candidates(ids, tf.constant(30, tf.int64), 30, V)  # tries == K: K * P
    np.testing.assert_allclose(exact.expected_count(ids).numpy(), 30 * p, rtol=1e-6)


# ------------------------------------------------------------------ the loss
def test_sampled_loss_is_token_weighted_like_the_full_one():
    """Padding adds nothing and counts nothing; (nll_sum, count) come back undivided."""
    rng = np.random.default_rng(0)
    features = tf.constant(rng.normal(size=(2, 4, 8)), tf.float32)
    weights = tf.Variable(rng.normal(size=(V, 8)).astype(np.float32))
    biases = tf.Variable(np.zeros(V, np.float32))
    targets = tf.constant([[5, 6, 0, 0], [7, 8, 9, 10]], tf.int32)
    c = sampling.log_uniform_candidates(KEY, 10, V)
    nll, count = losses.sampled_nll_sum_and_count(features, targets, weights, biases, c)
    assert float(count) == 6.0
    real = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool)
    labels = tf.constant(targets.numpy()[real].reshape(-1, 1), tf.int64)
    per_token = tf.nn.sampled_softmax_loss(
        weights, biases, labels, tf.constant(features.numpy()[real]), 10, V,
        sampled_values=c.sampled_values(labels), remove_accidental_hits=True)
    assert float(nll) == pytest.approx(float(tf.reduce_sum(per_token)), rel=1e-6)
    assert float(nll) > 6 * np.log(11) * 0.5  # a sum over 6 tokens, not a mean


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("kwargs,message", [
    (dict(num_sampled=100), "num-sampled 100 only applies to the sampled softmax; add "
                            "--softmax sampled or drop --num-sampled"),
    (dict(softmax="sampled", num_sampled=0), "num-sampled must be >= 1, got 0"),
    (dict(softmax="nce"), "unknown softmax 'nce'; expected one of: full, sampled"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        model_config(**kwargs)


def test_config_defaults_and_vocabulary_check():
    assert model_config().num_sampled is None
    assert model_config(softmax="sampled").num_sampled == 8192
    model_config(softmax="sampled", num_sampled=59).check_vocab_size(60)
    with pytest.raises(ConfigError, match="num-sampled 60 must be smaller than the "
                                          "vocabulary size 60; use --num-sampled 59"):
        model_config(softmax="sampled", num_sampled=60).check_vocab_size(60)


# ------------------------------------------------------------------ sparse end to end
TABLES = {"rnn_lm/embedding/embeddings", "rnn_lm/softmax/kernel", "rnn_lm/softmax/bias"}
BATCH = batch_of([[5, 6, 7, 0, 0], [8, 9, 10, 11, 2], [12, 13, 2, 0, 0]])


@functools.lru_cache(maxsize=None)
def one_sgd_step(strategy: str, softmax: str, tie: bool):
    """One plain-SGD train step of the plug-in; returns (weights before, after, the
    gradient types the optimizer's update_step saw by variable path, paths)."""
    dist = DistConfig() if strategy == "default" else DistConfig(
        strategy=strategy, devices=("/device:CPU:0", "/device:CPU:1"))
    plugin = build_strategy(dist)
    config = model_config(embed_dim=8, hidden_dim=8, tie_embeddings=tie, softmax=softmax,
                         **({"num_sampled": 6} if softmax == "sampled" else {}))
    with plugin.scope():
        model = build_model(config, 200, seed=0)
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build(model.trainable_variables)
    paths = [v.path for v in model.trainable_variables]
    seen = {}
    update_step = optimizer.update_step

    def spy(gradient, variable, learning_rate):
        seen[paths[optimizer._get_variable_index(variable)]] = type(gradient).__name__
        return update_step(gradient, variable, learning_rate)

    optimizer.update_step = spy
    before = [w.copy() for w in model.get_weights()]
    train = make_train_step(plugin, model, optimizer, clip_norm=0.0)
    batches = plugin.distribute(
        lambda ctx: per_replica(tf.data.Dataset.from_tensors(BATCH), ctx))
    out = train(next(iter(batches)))
    assert float(out.count) == 11.0
    return before, model.get_weights(), seen, paths


def touched_rows(tie: bool) -> set[int]:
    """The rows the batch's inputs, targets and step-0 candidates can reach."""
    key = Noise(0).key(output.CANDIDATE_SITE)  # step 0: the first update's draw
    candidates = set(sampling.log_uniform_candidates(key, 6, 200).ids.numpy().tolist())
    inputs = set(BATCH["inputs"].numpy().ravel().tolist())
    targets = set(BATCH["targets"].numpy().ravel().tolist())
    return {"embedding": inputs | (targets | candidates if tie else set()),
            "softmax": targets | candidates}


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
@pytest.mark.parametrize("tie", [False, True])
def test_one_sampled_sgd_step_changes_only_the_rows_it_touched(strategy, tie):
    before, after, seen, paths = one_sgd_step(strategy, "sampled", tie)
    rows = touched_rows(tie)
    assert len(rows["softmax"]) < 30  # of 200: most rows are untouched
    for path, b, a in zip(paths, before, after):
        if path not in TABLES:
            assert np.abs(a - b).max() > 0, path  # the RNN's weights are dense and move
            assert seen[path] != "IndexedSlices", path
            continue
        assert seen[path] == "IndexedSlices", (path, seen)
        changed = set(np.flatnonzero(np.any((a != b).reshape(len(a), -1), axis=1)).tolist())
        allowed = rows["embedding" if "embedding" in path else "softmax"] - {0}  # <pad>: 0
        assert changed and changed <= allowed, (path, sorted(changed - allowed))
        assert len(changed) >= len(allowed) - 2, path  # (a hit can cancel out exactly)


def test_the_full_softmax_still_hands_the_optimizer_dense_gradients():
    """The control: the full softmax's gradients reach the optimizer dense, as they
    always did, and every softmax row moves."""
    before, after, seen, paths = one_sgd_step("default", "full", False)
    assert set(seen.values()) != {"IndexedSlices"} and "IndexedSlices" not in seen.values()
    i = paths.index("rnn_lm/softmax/bias")
    assert np.all(after[i] != before[i])


def test_eval_and_export_logits_use_the_full_softmax():
    """A sampled model's call gives [B, T, V] logits over the whole vocabulary; the
    untied softmax kernel is stored one row per word."""
    model = build_model(model_config(embed_dim=8, hidden_dim=8, softmax="sampled",
                                    num_sampled=6), 200, seed=0)
    logits, _ = model(BATCH["inputs"])
    assert logits.shape == (3, 5, 200)
    assert model.softmax.kernel.shape == (200, 8)
    nll, count, _ = step.forward(model, BATCH, loss=output_loss(model.config))
    want = tf.nn.sparse_softmax_cross_entropy_with_logits(BATCH["targets"], logits)
    mask = losses.token_mask(BATCH["targets"])
    assert float(nll) == pytest.approx(float(tf.reduce_sum(want * mask)), rel=1e-6)
    assert float(count) == 11.0


# ------------------------------------------------------------------ the optimizers
def rows_moved_by_the_second_step(optimizer) -> set[int]:
    """Two IndexedSlices steps on a [6, 2] table, rows {0, 1} then row {4}: which rows
    the second step changed."""
    table = keras.Variable(np.ones((6, 2), np.float32))
    optimizer.build([table])
    optimizer.apply([tf.IndexedSlices(tf.ones([2, 2]), tf.constant([0, 1]), [6, 2])], [table])
    before = table.numpy().copy()
    optimizer.apply([tf.IndexedSlices(tf.ones([1, 2]), tf.constant([4]), [6, 2])], [table])
    return set(np.flatnonzero(np.any(table.numpy() != before, axis=1)).tolist())


@pytest.mark.parametrize("make,rows", [
    (lambda: keras.optimizers.SGD(0.1), {4}),
    (lambda: keras.optimizers.Adagrad(0.1), {4}),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), {0, 1, 4}),
    (lambda: keras.optimizers.Adam(0.1), {0, 1, 4}),
    (lambda: keras.optimizers.SGD(0.1, weight_decay=0.1), {0, 1, 2, 3, 4, 5}),
])
def test_which_keras_optimizers_keep_sparse_updates_sparse(make, rows):
    """What the README's table says: plain SGD and Adagrad move only the rows of the
    step's gradient; momentum and Adam move every row their slots reach; weight decay
    every row."""
    assert rows_moved_by_the_second_step(make()) == rows
