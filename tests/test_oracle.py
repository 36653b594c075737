"""The ``default`` strategy's update equals one computed by hand, without tfpar.objective.

Every equivalence test compares a strategy with ``default``, and both run
``tfpar/objective/step.py``: a wrong clip factor, per-token normalisation or finite guard
there would make every strategy agree. Here the one-device update is written out with
plain TensorFlow and Keras (the :class:`Oracle`), on a copy of the same initial weights::

    loss  = (sum of the real target tokens' NLL) / (number of real target tokens)
            (tf.nn.sparse_softmax_cross_entropy_with_logits on the model's logits, or
             tf.nn.sampled_softmax_loss; padding (target 0) masked out of both sums)
    g     = tf.GradientTape().gradient(loss, the model's trainable variables)
    skip the update when |g| or the loss is not finite, else
    g     = tf.clip_by_global_norm(g, clip)[0]
    SGD (momentum 0.5, lr 0.5) apply_gradients(g)

and tfpar's ``default`` train step must give the same loss, gradient norm, weights and
momentum slots after every step: on steps whose norm is above the clip norm (the factor
matters; a wrongly scaled gradient gives the same weights, only its reported norm
differs) and below it (the normalisation matters), with the full and the sampled
softmax, and over a non-finite batch (nothing changes). ``mirrored`` on 2 devices is
checked against the oracle directly as well: on one device the local token count is the
global one, so only replicas can show a replica dividing by its own.
The oracle uses tfpar only for the model (tfpar.model.lm.build_model) and, for the
sampled softmax, re-derives the candidates from the documented spec (a stateless Philox
draw keyed by (seed, step), TensorFlow's unique log-uniform sampler) instead of calling
tfpar.objective.sampling; a separate test checks the two draws agree.

The learning-rate schedule is checked against hand-computed numbers, and the optimizer
``optimizer_factory`` builds against an SGD step computed by hand.

Batches are padded sentence-mode batches (``fixed_shapes=False``): the step then runs
TensorFlow's own kernels, not XLA's fused ones (tfpar.model.xla), so the oracle (eager,
TensorFlow's kernels) agrees to float32 round-off: the full softmax's weights come out
bit-identical, the sampled softmax's within ~1e-8 (the oracle sums the real tokens'
losses after a boolean mask, tfpar multiplies by the mask), far inside the tolerances.
"""

import dataclasses
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import batch_of, model_config, small_config, snapshot, train_config
from tfpar.config import DistConfig, ModelConfig
from tfpar.parallel.rows import per_replica
from tfpar.model.lm import build_model
from tfpar.parallel.registry import build_strategy
from tfpar.training.schedule import EpochSchedule, optimizer_factory
from tfpar.training.state import build_train_state, named_weights
from tfpar.objective.step import make_train_step

SEED = 3
V = 40
FULL = model_config(embed_dim=12, hidden_dim=12, layers=2)
SAMPLED = dataclasses.replace(FULL, softmax="sampled", num_sampled=8)
LR, MOMENTUM = 0.5, 0.5
RTOL, ATOL = 1e-5, 1e-6

# Three padded batches of 5 rows x 6 targets (0 = padding; 2 = <eos>): 22, 23 and 29
# real targets; every row has a real token.
BATCHES = [
    [[5, 6, 7, 8, 2, 0], [9, 10, 11, 2, 0, 0], [12, 13, 14, 15, 16, 2],
     [17, 2, 0, 0, 0, 0], [18, 19, 20, 21, 2, 0]],
    [[22, 23, 2, 0, 0, 0], [24, 25, 26, 27, 28, 2], [29, 30, 31, 2, 0, 0],
     [3, 4, 5, 6, 7, 2], [8, 9, 10, 2, 0, 0]],
    [[11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 2], [22, 23, 24, 25, 2, 0],
     [26, 27, 28, 29, 30, 31], [32, 33, 34, 35, 36, 2]],
]
# Clip norms well below / well above every step's gradient norm (asserted per step).
CLIP_BELOW, CLIP_ABOVE = 0.05, 100.0


# ----------------------------------------------------------------------------- the oracle
def log_uniform_p(k, range_max):
    """P(k) = log((k + 2) / (k + 1)) / log(V + 1), TensorFlow's LogUniformSampler."""
    k = np.asarray(k, np.float64)
    return np.log((k + 2.0) / (k + 1.0)) / np.log(range_max + 1.0)


def hand_candidates(step: int, num_sampled: int, range_max: int):
    """Step ``step``'s shared candidates from the documented spec, without tfpar: the
    Philox key (seed, site -1) folded with the step; u ~ U[0, 1) float64 from it; draws
    floor(exp(u log(V + 1))) - 1; the first K distinct ids in the order drawn, ``tries``
    the draws that took. Returns (ids [K] int64, tries)."""
    key = tf.random.experimental.stateless_fold_in(tf.constant([SEED, -1], tf.int64),
                                                   tf.constant(step, tf.int64))
    u = tf.random.stateless_uniform([4096], seed=key, dtype=tf.float64, alg="philox").numpy()
    draws = np.clip(np.floor(np.exp(u * np.log(range_max + 1.0))).astype(np.int64) - 1,
                    0, range_max - 1)
    ids = []
    for tries, d in enumerate(draws, 1):
        if d not in ids:
            ids.append(int(d))
            if len(ids) == num_sampled:
                return np.array(ids, np.int64), tries
    raise AssertionError("4096 draws hold fewer than K distinct ids")


def hand_sampled_values(step: int, labels: np.ndarray, num_sampled: int, range_max: int):
    """``sampled_softmax_loss``'s sampled_values for ``labels`` [N, 1]: the ids and the
    expected counts of the unique sampler, 1 - (1 - P)^tries (K P when tries == K)."""
    ids, tries = hand_candidates(step, num_sampled, range_max)

    def expected(k):
        p = log_uniform_p(k, range_max)
        count = p * num_sampled if tries == num_sampled else -np.expm1(tries * np.log1p(-p))
        return tf.constant(count, tf.float32)

    return tf.constant(ids), expected(labels), expected(ids)


class Oracle:
    """The one-device update written by hand (see the module docstring)."""

    def __init__(self, config: ModelConfig, weights, clip: float, learning_rate=LR,
                 momentum=MOMENTUM):
        self.config, self.clip = config, clip
        self.model = build_model(config, V, seed=SEED, fixed_shapes=False)
        self.model.set_weights(weights)
        self.optimizer = keras.optimizers.SGD(learning_rate, momentum=momentum)
        self.optimizer.build(self.model.trainable_variables)
        self.updates = 0  # updates applied: the step that keys the sampled candidates

    def loss_and_gradients(self, batch):
        """``(loss, count, dense gradients)`` at the current weights."""
        inputs, targets = batch["inputs"], batch["targets"].numpy()
        real = targets != 0
        count = int(real.sum())
        labels = targets[real]  # [N] real targets, row by row
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            if self.config.softmax == "full":
                logits, _ = self.model(inputs, training=True)  # [B, T, V]
                nll = tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=tf.constant(labels), logits=tf.boolean_mask(logits, real))
            else:
                x, _ = self.model.features(inputs, training=True)  # [B, T, H]
                column = labels.reshape(-1, 1).astype(np.int64)
                nll = tf.nn.sampled_softmax_loss(
                    weights=tf.convert_to_tensor(self.model.softmax.kernel),  # [V, H]
                    biases=tf.convert_to_tensor(self.model.softmax.bias),
                    labels=tf.constant(column), inputs=tf.boolean_mask(x, real),
                    num_sampled=self.config.num_sampled, num_classes=V,
                    sampled_values=hand_sampled_values(self.updates, column,
                                                       self.config.num_sampled, V),
                    remove_accidental_hits=True)
            loss = tf.reduce_sum(nll) / count
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]  # dense
        return loss, count, grads

    def train(self, batch):
        """One update; returns ``(loss, count, global norm before clipping, applied)``."""
        loss, count, grads = self.loss_and_gradients(batch)
        if self.clip:
            clipped, norm = tf.clip_by_global_norm(grads, self.clip)
        else:
            clipped, norm = grads, tf.linalg.global_norm(grads)
        applied = math.isfinite(float(norm)) and math.isfinite(float(loss))
        if applied:
            self.optimizer.apply_gradients(zip(clipped, self.model.trainable_variables))
            self.updates += 1
        return float(loss), count, float(norm), applied

    def momenta(self):
        return [v.numpy() for v in self.optimizer.variables
                if v.path.split("/")[-1] not in ("iteration", "learning_rate")]


# ----------------------------------------------------------------------------- tfpar
@dataclasses.dataclass
class Tfpar:
    """A tfpar strategy's train state and step."""

    plugin: object
    state: object
    step: object

    def train(self, batch):
        """One train step on the global ``batch``, in the form the plug-in's step takes."""
        dataset = tf.data.Dataset.from_tensors(batch)
        return self.step(next(iter(self.plugin.distribute(
            lambda ctx: per_replica(dataset, ctx)))))

    def momenta(self):
        return [v.numpy() for v in self.state.optimizer.variables
                if v.path.split("/")[-1] not in ("iteration", "learning_rate")]


def tfpar_run(config: ModelConfig, weights, clip: float, dist=DistConfig(),
              make_optimizer=None) -> Tfpar:
    """tfpar's strategy ``dist`` (``default``: one device): the train state and step."""
    plugin = build_strategy(dist)
    make_optimizer = make_optimizer or (
        lambda epoch, lr_scale: keras.optimizers.SGD(LR, momentum=MOMENTUM))
    state = build_train_state(plugin.scope(), config, V, seed=SEED,
                              make_optimizer=make_optimizer, initial_weights=weights,
                              fixed_shapes=False)
    return Tfpar(plugin, state,
                 make_train_step(plugin, state.model, state.optimizer, clip_norm=clip))


def initial_weights(config: ModelConfig):
    return build_model(config, V, seed=SEED, fixed_shapes=False).get_weights()


def assert_same_arrays(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{what} {i}")


def assert_same_state(ours: Tfpar, oracle: Oracle, what):
    assert_same_arrays(ours.state.model.get_weights(), oracle.model.get_weights(),
                       f"{what}: weight")
    assert_same_arrays(ours.momenta(), oracle.momenta(), f"{what}: momentum slot")
    assert ours.state.step == oracle.updates, what


def compare_step(ours: Tfpar, oracle: Oracle, rows, what):
    """One step of both; returns the oracle's gradient norm (before clipping)."""
    batch = batch_of(rows)
    out = ours.train(batch)
    loss, count, norm, applied = oracle.train(batch)
    assert applied, what
    assert float(out.count) == count, what
    assert float(out.nll_sum) / float(out.count) == pytest.approx(loss, rel=RTOL), what
    assert float(out.grad_norm) == pytest.approx(norm, rel=RTOL), what
    assert_same_state(ours, oracle, what)
    return norm


# ----------------------------------------------------------------------------- the step
@pytest.mark.parametrize("softmax", ["full", "sampled"])
@pytest.mark.parametrize("regime", ["clipped", "unclipped"])
def test_default_steps_equal_the_hand_computed_update(softmax, regime):
    """Three SGD-with-momentum steps on padded batches: after each one, tfpar's loss
    (token-weighted), gradient norm, weights, momentum slots and step count equal the
    oracle's. Clipped: every norm is above the clip norm, so the clip factor is
    exercised; unclipped: every norm is below it, so a gradient scaled wrongly (a mean
    over padding, a sum instead of a mean) changes the update."""
    config = FULL if softmax == "full" else SAMPLED
    clip = CLIP_BELOW if regime == "clipped" else CLIP_ABOVE
    weights = initial_weights(config)
    ours, oracle = tfpar_run(config, weights, clip), Oracle(config, weights, clip)
    for k, rows in enumerate(BATCHES):
        norm = compare_step(ours, oracle, rows, f"step {k}")
        if regime == "clipped":
            assert norm > 2 * clip, (k, norm)  # the factor is well below 1
        else:
            assert norm < clip / 2, (k, norm)
    moved = max(float(np.max(np.abs(a - b)))
                for a, b in zip(ours.state.model.get_weights(), weights))
    assert moved > 1e-2  # the steps moved the weights well beyond the tolerance


def test_two_mirrored_replicas_equal_the_hand_computed_update():
    """The oracle also checks a data-parallel strategy directly (not only through
    ``default``): mirrored on 2 devices, whose replicas hold 3 and 2 rows with unequal
    token counts (15 and 7 in the first batch), gives the one-device update on unclipped
    steps, so every replica divides by the global count, never its own."""
    weights = initial_weights(FULL)
    dist = DistConfig(strategy="mirrored", devices=("/device:CPU:0", "/device:CPU:1"))
    ours = tfpar_run(FULL, weights, CLIP_ABOVE, dist)
    oracle = Oracle(FULL, weights, CLIP_ABOVE)
    assert ours.plugin.num_replicas == 2
    for k, rows in enumerate(BATCHES[:2]):
        assert compare_step(ours, oracle, rows, f"step {k}") < CLIP_ABOVE / 2


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_a_sentence_mode_step_is_traced_once_for_every_batch_shape(strategy):
    """Sentence batches vary in rows and length from step to step: the train and eval
    steps are each traced once, for every shape (reduce_retracing alone traces the first
    batch's exact shape, then again for the second: the step's graph built twice), and
    each batch still gets its own update: what the oracle computes for it."""
    from tfpar.objective.step import make_eval_step

    weights = initial_weights(FULL)
    dist = DistConfig() if strategy == "default" else DistConfig(
        strategy="mirrored", devices=("/device:CPU:0", "/device:CPU:1"))
    ours, oracle = tfpar_run(FULL, weights, CLIP_ABOVE, dist), Oracle(FULL, weights, CLIP_ABOVE)
    evaluate = make_eval_step(ours.plugin, ours.state.model)
    shapes = [BATCHES[0], BATCHES[1][:3], [row[:4] for row in BATCHES[2]]]  # [5, 6] [3, 6] [5, 4]
    for k, rows in enumerate(shapes):
        compare_step(ours, oracle, rows, f"step {k}")
        dataset = tf.data.Dataset.from_tensors(batch_of(rows))
        evaluate(next(iter(ours.plugin.distribute(lambda ctx: per_replica(dataset, ctx)))))
    assert ours.step.function.experimental_get_tracing_count() == 1
    assert evaluate.function.experimental_get_tracing_count() == 1


def test_a_replica_handed_no_rows_leaves_the_update_of_the_others():
    """When one multi_worker input pipeline has ended before another, ``tf.distribute``
    hands its replicas batches of 0 rows (which Keras RNN kernels reject); the replica
    then runs one row of padding, and the step is the one-device update on the other
    replica's rows alone."""
    weights = initial_weights(FULL)
    dist = DistConfig(strategy="mirrored", devices=("/device:CPU:0", "/device:CPU:1"))
    ours = tfpar_run(FULL, weights, CLIP_ABOVE, dist)
    oracle = Oracle(FULL, weights, CLIP_ABOVE)
    batch = batch_of(BATCHES[0])
    rows = {**batch, "rows": tf.range(5, dtype=tf.int32)}
    empty = {k: v[:0] for k, v in rows.items()}
    shares = tf.data.Dataset.from_tensors(rows).concatenate(tf.data.Dataset.from_tensors(empty))
    out = ours.step(next(iter(ours.plugin.distribute(lambda ctx: shares))))
    loss, count, norm, _ = oracle.train(batch)
    assert float(out.count) == count
    assert float(out.nll_sum) / float(out.count) == pytest.approx(loss, rel=RTOL)
    assert float(out.grad_norm) == pytest.approx(norm, rel=RTOL)
    assert_same_state(ours, oracle, "a 0-row replica")


def test_the_hand_candidates_are_tfpars():
    """The oracle's candidates (re-derived from the spec) are the ones tfpar's sampler
    draws for steps 0..2, ids and tries; so the sampled-softmax comparison above checks
    tfpar's loss, not only its sampler."""
    from tfpar.model.noise import Noise
    from tfpar.objective import output, sampling

    noise = Noise(SEED)
    for k in range(3):
        noise.step = lambda: tf.constant(k, tf.int64)
        c = sampling.log_uniform_candidates(noise.key(output.CANDIDATE_SITE),
                                            SAMPLED.num_sampled, V)
        ids, tries = hand_candidates(k, SAMPLED.num_sampled, V)
        np.testing.assert_array_equal(c.ids.numpy(), ids)
        assert int(c.tries) == tries
        # Expected counts: tfpar's against the unique sampler's formula.
        labels = np.array([[0], [5], [39]], np.int64)
        _, want_true, want_sampled = hand_sampled_values(k, labels, SAMPLED.num_sampled, V)
        np.testing.assert_allclose(c.expected_count(tf.constant(labels)).numpy(),
                                   want_true.numpy(), rtol=1e-6)
        np.testing.assert_allclose(c.expected_count(c.ids).numpy(), want_sampled.numpy(),
                                   rtol=1e-6)


# ----------------------------------------------------------------------------- non-finite
P = 37  # its embedding row becomes NaN: only the NaN batch reads it (as an input)
Q = 38  # its softmax column becomes huge: only the inf batch predicts it (once)
NAN_ROWS = [BATCHES[0][0], BATCHES[0][1], BATCHES[0][2], [P, 3, 4, 2, 0, 0], BATCHES[0][4]]
INF_ROWS = [BATCHES[0][0], BATCHES[0][1], BATCHES[0][2], [3, Q, 4, 2, 0, 0], BATCHES[0][4]]


def poison(model, kind):
    """Edits the weights so that the ``kind`` batch is non-finite; returns the undo."""
    weights = named_weights(model)
    if kind == "nan":  # NaN loss and gradient
        edits = {"embedding:embeddings": lambda w: w.__setitem__(P, np.nan)}
    else:  # the global norm overflows float32, the loss stays finite (~1e38)
        edits = {"softmax:kernel": lambda w: w.__setitem__((slice(None), Q), 1e25),
                 "softmax:bias": lambda w: w.__setitem__(Q, -1e38)}
    saved = {name: weights[name].numpy() for name in edits}
    for name, edit in edits.items():
        value = saved[name].copy()
        edit(value)
        weights[name].assign(value)
    return lambda: [weights[name].assign(value) for name, value in saved.items()]


def test_a_non_finite_batch_changes_nothing_as_by_hand():
    """A good step (the momentum slots become non-zero), then a batch with a NaN loss
    and gradient and a batch whose gradient norm overflows (finite loss): the oracle
    finds each non-finite and skips it, and tfpar leaves every weight, slot and the step
    count bit-identical; the next good step again equals the oracle's (a skipped step
    is not counted, and without the guard the momentum alone would move the weights)."""
    weights = initial_weights(FULL)
    ours, oracle = tfpar_run(FULL, weights, 5.0), Oracle(FULL, weights, 5.0)
    compare_step(ours, oracle, BATCHES[0], "good step")
    assert all(np.any(m != 0) for m in ours.momenta())
    for kind, rows in (("nan", NAN_ROWS), ("inf", INF_ROWS)):
        undo_ours, undo_oracle = poison(ours.state.model, kind), poison(oracle.model, kind)
        before = snapshot(ours.state)
        batch = batch_of(rows)
        out = ours.train(batch)
        loss, _, norm, applied = oracle.train(batch)
        assert not applied and not math.isfinite(norm), (kind, norm)
        if kind == "inf":  # only the norm is bad: the guard must look at it
            assert math.isfinite(loss), loss
        assert not math.isfinite(float(out.grad_norm)), kind
        after = snapshot(ours.state)
        for v, b, a in zip(ours.state.variables(), before, after):
            assert a.tobytes() == b.tobytes(), f"{kind}: {v.path} changed"
        assert ours.state.step == oracle.updates == 1, kind
        undo_ours()
        undo_oracle()
        assert_same_state(ours, oracle, f"after the {kind} batch")
    compare_step(ours, oracle, BATCHES[1], "the next good step")


# ----------------------------------------------------------------------------- the schedule
# EpochSchedule(base 0.8, decay 0.5, decay_after 2, warm-up 4 steps), by hand. ``epoch``
# counts the epochs finished (0 during the first); ``step`` is the optimizer's step,
# 0 for the first update. The first two epochs (0, 1) train at the base rate; from
# epoch 2 on, the rate halves each epoch (0.8 * 0.5 ** (epoch - 1)). Warm-up: the rate
# times (step + 1) / 4 for steps 0..3 (1/4, 2/4, 3/4, 1), then 1.
SCHEDULE = [
    # (epoch, step, lr)
    (0, 0, 0.2),    # 0.8 * 1/4
    (0, 1, 0.4),    # 0.8 * 2/4
    (0, 2, 0.6),    # 0.8 * 3/4
    (0, 3, 0.8),    # warm-up done
    (0, 4, 0.8),
    (0, 50, 0.8),
    (1, 4, 0.8),    # the second epoch: still undecayed
    (1, 0, 0.2),
    (2, 4, 0.4),    # the first decayed epoch: 0.8 * 0.5
    (2, 1, 0.2),    # ... within the warm-up: 0.4 * 2/4
    (3, 9, 0.2),    # 0.8 * 0.25
    (5, 20, 0.05),  # 0.8 * 0.5 ** 4
]


def test_the_schedule_gives_the_hand_computed_rates():
    epoch = tf.Variable(0, dtype=tf.int64)
    schedule = EpochSchedule(0.8, 0.5, 2, 4, epoch)
    for e, s, want in SCHEDULE:
        epoch.assign(e)
        got = float(schedule(tf.constant(s, tf.int64)))
        assert got == pytest.approx(want, rel=1e-6), (e, s, got, want)


def test_the_factorys_optimizer_applies_the_decayed_rate_in_a_step():
    """``optimizer_factory`` for ``--optimizer sgd --lr 0.8 --lr-decay 0.5 --decay-after
    2`` (no clipping, no momentum): a step at epoch e moves every weight by exactly
    -lr(e) x the hand gradient, lr 0.8, 0.4, 0.2 for epochs 1, 2, 3."""
    config = small_config(train=train_config(optimizer="sgd", lr=0.8, lr_decay=0.5, decay_after=2,
                                      clip_norm=0.0))
    weights = initial_weights(FULL)
    ours = tfpar_run(FULL, weights, config.train.clip_norm,
                     make_optimizer=optimizer_factory(config.train, num_replicas=1))
    oracle = Oracle(FULL, weights, 0.0)  # only its gradients are used here
    for e, lr, rows in ((1, 0.8, BATCHES[0]), (2, 0.4, BATCHES[1]), (3, 0.2, BATCHES[2])):
        ours.state.epoch.assign(e)
        before = [v.numpy() for v in ours.state.model.trainable_variables]
        oracle.model.set_weights(ours.state.model.get_weights())
        _, _, grads = oracle.loss_and_gradients(batch_of(rows))
        ours.train(batch_of(rows))
        want = [w - lr * g.numpy() for w, g in zip(before, grads)]
        got = [v.numpy() for v in ours.state.model.trainable_variables]
        assert_same_arrays(got, want, f"epoch {e}: weight")
        moved = max(float(np.max(np.abs(g.numpy()))) for g in grads) * lr
        assert moved > 1e-3, e  # the update is well above the tolerance
