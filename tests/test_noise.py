"""Dropout masks keyed by (seed, step, site, global row): tfpar.model.noise."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import model_config
from tfpar.errors import ConfigError
from tfpar.model.lm import build_model
from tfpar.model.noise import Noise
from tfpar.objective import losses

IDS = tf.constant([[2, 3, 4, 5, 6], [7, 8, 9, 2, 3], [4, 4, 5, 0, 0], [9, 8, 7, 6, 5],
                   [3, 3, 3, 3, 0]])


def logits_of(model, ids=IDS, rows=None, step=0):
    model.noise.step = lambda: tf.constant(step, tf.int64)
    return model(ids, training=True, rows=rows)[0].numpy()


def test_a_row_of_a_philox_table_does_not_depend_on_the_table_size():
    # The property per_row relies on: a replica draws only max(rows) + 1 rows.
    seed = tf.constant([3, 7], tf.int64)
    for tail in ([1, 7], [5, 4]):
        small = tf.random.stateless_uniform([3, *tail], seed=seed, alg="philox")
        large = tf.random.stateless_uniform([9, *tail], seed=seed, alg="philox")
        np.testing.assert_array_equal(small.numpy(), large.numpy()[:3])


@pytest.mark.parametrize("extra", [dict(), dict(locked_dropout=True),
                                   dict(dropout=0.0, embed_dropout=0.3),
                                   dict(dropout=0.0, weight_drop=0.4)])
def test_a_shard_of_rows_gets_one_devices_masks_for_those_rows(extra):
    config = model_config(**{"embed_dim": 6, "hidden_dim": 6, "layers": 2, "dropout": 0.4,
                            **extra})
    model = build_model(config, 12, seed=3)
    whole = logits_of(model, step=5)
    for rows in ([0, 1], [2, 3, 4], [4]):
        part = logits_of(model, tf.gather(IDS, rows), tf.constant(rows), step=5)
        np.testing.assert_allclose(part, whole[rows], rtol=0, atol=1e-6)
    # The masks are random: another step differs, and per-row masks differ by row.
    assert not np.allclose(logits_of(model, step=6), whole)
    as_other_rows = logits_of(model, IDS[:2], tf.constant([2, 3]), step=5)
    assert np.allclose(as_other_rows, whole[:2]) == (not config.dropout)
    assert not np.allclose(whole, model(IDS, training=False)[0].numpy())


def test_locked_masks_are_shared_by_the_time_steps_of_a_row():
    noise = Noise(seed=1)
    x = tf.ones([3, 6, 40])
    per_token = noise.per_row(x, 0.5, 0, tf.range(3), locked=False).numpy()
    locked = noise.per_row(x, 0.5, 0, tf.range(3), locked=True).numpy()
    assert (locked == locked[:, :1]).all()
    assert not (per_token == per_token[:, :1]).all()
    assert set(np.unique(locked)) == {0.0, 2.0}
    assert 0.3 < (locked == 0).mean() < 0.7


def test_word_type_dropout_drops_a_word_everywhere_it_occurs():
    model = build_model(model_config(embed_dim=8, hidden_dim=8, embed_dropout=0.5), 12, seed=0)
    model.noise.step = lambda: tf.constant(2, tf.int64)
    ids = tf.constant([[2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    x, _ = model.embed(ids, training=True)
    dropped = np.all(x.numpy()[0] == 0, axis=-1)
    assert dropped[0] == dropped[2] and dropped[1] == dropped[3]
    assert 0 < dropped.sum() < len(dropped)
    kept = ~dropped
    np.testing.assert_allclose(x.numpy()[0][kept],
                               2 * model.embedding(ids).numpy()[0][kept], rtol=1e-6)


def test_weight_drop_zeroes_the_gradient_of_dropped_recurrent_weights():
    model = build_model(model_config(embed_dim=6, hidden_dim=6, weight_drop=0.5), 12, seed=0)
    model.noise.step = lambda: tf.constant(1, tf.int64)
    kernel = model.rnns[0].cell.recurrent_kernel
    with tf.GradientTape() as tape:
        logits, _ = model(IDS, training=True)
        nll, count = losses.nll_sum_and_count(logits, IDS)
    grad = tape.gradient(nll, kernel).numpy()
    mask = model.noise.shared(tf.shape(kernel), 0.5, model.config.layers + 2).numpy()
    assert 0.3 < (mask == 0).mean() < 0.7
    assert (grad[mask == 0] == 0).all()
    assert (grad[mask != 0] != 0).mean() > 0.9
    # Evaluation uses the whole matrix.
    assert not np.allclose(model(IDS, training=False)[0].numpy(), logits.numpy())


@pytest.mark.parametrize("field", ["dropout_input", "dropout_hidden", "dropout_output",
                                   "embed_dropout", "weight_drop"])
def test_a_rate_outside_zero_to_one_is_refused_by_name(field):
    with pytest.raises(ConfigError, match=f"{field.replace('_', '-')} must be in \\[0, 1\\), "
                                          "got 1.0"):
        model_config(**{field: 1.0})


def test_each_site_takes_its_own_rate_over_dropout():
    config = model_config(layers=2, dropout=0.3, dropout_input=0.6, dropout_output=0.0)
    assert [config.dropout_at(s) for s in ("input", "hidden", "output")] == [0.6, 0.3, 0.0]
