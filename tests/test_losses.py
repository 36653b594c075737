import math

import pytest
import tensorflow as tf

from tfpar.objective import losses


def test_nll_sum_and_count_hand_computed():
    # Two rows, vocab 3; the second row's last position is padding.
    logits = tf.constant([[[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]],
                          [[0.0, math.log(3.0), 0.0], [5.0, 5.0, 5.0]]])
    targets = tf.constant([[1, 2], [1, 0]])
    nll, count = losses.nll_sum_and_count(logits, targets)
    lse = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    expected = math.log(3.0) + (lse - 3.0) + -math.log(3.0 / 5.0)
    assert count.numpy() == 3.0
    assert nll.numpy() == pytest.approx(expected, rel=1e-6)


def test_all_padding_gives_zero_and_zero():
    nll, count = losses.nll_sum_and_count(tf.random.normal([2, 4, 5]), tf.zeros([2, 4], tf.int32))
    assert (nll.numpy(), count.numpy()) == (0.0, 0.0)


def test_perplexity_is_exp_of_total_not_mean_of_batch_means():
    # Batch A: 1 token with nll 4; batch B: 3 tokens with nll 0 each.
    assert losses.perplexity(4.0 + 0.0, 1 + 3) == pytest.approx(math.exp(1.0))
    assert math.isnan(losses.perplexity(0.0, 0))
    assert losses.perplexity(1e6, 1) == math.inf


def test_token_count_ignores_padding():
    assert losses.token_count(tf.constant([[3, 0, 0], [4, 5, 0]])).numpy() == 3.0
