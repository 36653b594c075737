"""tfpar.serving.sample: in-graph generation (prompt padding, token choice, stopping, text)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import model_config
from tfpar.serving import sample
from tfpar.model.lm import build_model
from tfpar.data.vocab import EOS_ID, PAD_ID, UNK_ID, Vocab

VOCAB = Vocab.build(["a b c d e f g h"] * 3)  # ids: 0 pad, 1 unk, 2 eos, 3.. a..h


class FixedLogits:
    """A stand-in model whose next-token logits are always ``row`` (state: a step count)."""

    def __init__(self, row):
        self.row = tf.constant(row, tf.float32)

    def __call__(self, inputs, initial_state=None, training=False):
        batch, steps = tf.shape(inputs)[0], tf.shape(inputs)[1]
        logits = tf.tile(self.row[None, None, :], [batch, steps, 1])
        count = tf.zeros([batch, 1]) if initial_state is None else initial_state[0][0]
        return logits, [[count + 1.0]]


def run(model, prompts, *, max_tokens=8, temperature=1.0, top_k=0, seed=0, stop_at_eos=True):
    table = VOCAB.lookup_table()
    ids, lengths = sample.prompt_ids(tf.constant(prompts), table, tokenizer="whitespace")
    return sample.generate_ids(
        model, ids, lengths, max_tokens=tf.constant(max_tokens), top_k=tf.constant(top_k),
        temperature=tf.constant(temperature, tf.float32), seed=tf.constant(seed),
        stop_at_eos=tf.constant(stop_at_eos)).numpy()


def test_prompt_ids_prepend_eos_right_pad_and_map_pad_literal_to_unk():
    ids, lengths = sample.prompt_ids(tf.constant(["a b", "", "zz <pad> c"]),
                                     VOCAB.lookup_table(), tokenizer="whitespace")
    a, b, c = VOCAB.encode("a b c")
    np.testing.assert_array_equal(ids.numpy(), [[EOS_ID, a, b, 0], [EOS_ID, 0, 0, 0],
                                                [EOS_ID, UNK_ID, UNK_ID, c]])
    np.testing.assert_array_equal(lengths.numpy(), [3, 1, 4])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_padded_prompt_ends_in_the_state_of_the_prompt_run_alone(cell):
    model = build_model(model_config(cell=cell, layers=2, embed_dim=8, hidden_dim=8), 11)
    ids, lengths = sample.prompt_ids(tf.constant(["a b c d", "a"]), VOCAB.lookup_table(),
                                     tokenizer="whitespace")
    logits, state = model(ids)
    alone_logits, alone_state = model(ids[1:, :2])
    for layer, alone in zip(state, alone_state):
        for padded, single in zip(layer, alone):
            np.testing.assert_allclose(padded[1].numpy(), single[0].numpy(), atol=1e-6)
    last = tf.gather(logits, lengths - 1, axis=1, batch_dims=1)
    np.testing.assert_allclose(last[1].numpy(), alone_logits[0, -1].numpy(), atol=1e-6)


def test_greedy_equals_a_step_by_step_argmax_of_the_model():
    model = build_model(model_config(embed_dim=8, hidden_dim=8), len(VOCAB), seed=3)
    got = run(model, ["a b"], max_tokens=6, temperature=0.0)[0]
    ids = [EOS_ID] + VOCAB.encode("a b")
    expected = []
    for _ in range(6):
        logits, _ = model(tf.constant([ids]))
        row = logits[0, -1].numpy()
        row[[PAD_ID, UNK_ID]] = -np.inf
        expected.append(int(row.argmax()))
        if expected[-1] == EOS_ID:
            break
        ids.append(expected[-1])
    assert list(got[:len(expected)]) == expected
    assert all(t == PAD_ID for t in got[len(expected):])


def test_top_k_1_and_temperature_0_are_both_greedy():
    model = build_model(model_config(embed_dim=8, hidden_dim=8), len(VOCAB), seed=4)
    greedy = run(model, ["a", "c d"], temperature=0.0, seed=1)
    np.testing.assert_array_equal(run(model, ["a", "c d"], top_k=1, seed=2), greedy)


def test_same_seed_same_tokens_other_seed_other_tokens():
    model = FixedLogits(np.zeros(len(VOCAB)))  # uniform over the 9 allowed tokens
    first = run(model, ["a"] * 4, max_tokens=12, seed=7)
    np.testing.assert_array_equal(run(model, ["a"] * 4, max_tokens=12, seed=7), first)
    assert not np.array_equal(run(model, ["a"] * 4, max_tokens=12, seed=8), first)


def test_never_picks_pad_or_unk_even_when_they_are_most_likely():
    row = np.zeros(len(VOCAB))
    row[[PAD_ID, UNK_ID]] = 50.0
    row[EOS_ID] = -50.0
    model = FixedLogits(row)
    for kwargs in ({"temperature": 1.0}, {"temperature": 0.0}, {"top_k": 2}, {"top_k": 1}):
        out = run(model, ["a", "b"], max_tokens=20, **kwargs)
        assert out.shape == (2, 20)
        assert not np.isin(out, [PAD_ID, UNK_ID]).any(), kwargs


def test_top_k_keeps_only_the_k_most_likely_allowed_tokens():
    row = np.zeros(len(VOCAB))
    row[[PAD_ID, UNK_ID]] = 9.0  # banned: must not take any of the k places
    row[5], row[7], row[EOS_ID] = 3.0, 3.0, -50.0
    out = run(FixedLogits(row), ["a"] * 8, max_tokens=10, top_k=2, temperature=5.0)
    assert set(np.unique(out)) == {5, 7}


def test_rows_stop_at_eos_independently_and_pad_after():
    row = np.full(len(VOCAB), -10.0)
    row[EOS_ID] = 10.0
    out = run(FixedLogits(row), ["a", "b c"], max_tokens=5, temperature=0.0)
    # Every row ends at once; the loop stops, so only one column is generated.
    np.testing.assert_array_equal(out, [[EOS_ID], [EOS_ID]])


class Alternating(FixedLogits):
    """Greedy picks ``a`` after ``<eos>`` and ``<eos>`` after anything else."""

    def __init__(self):
        pass

    def __call__(self, inputs, initial_state=None, training=False):
        a = VOCAB.encode("a")[0]
        after_eos = tf.one_hot(a, len(VOCAB)) * 10.0
        after_word = tf.one_hot(EOS_ID, len(VOCAB)) * 10.0
        logits = tf.where(tf.equal(inputs, EOS_ID)[..., None], after_eos, after_word)
        return logits, [[tf.zeros([tf.shape(inputs)[0], 1])]]


def test_without_stop_at_eos_a_continuation_crosses_sentence_ends():
    a = VOCAB.encode("a")[0]
    went_on = run(Alternating(), ["a"], max_tokens=5, temperature=0.0, stop_at_eos=False)
    np.testing.assert_array_equal(went_on, [[EOS_ID, a, EOS_ID, a, EOS_ID]])
    stopped = run(Alternating(), ["a"], max_tokens=5, temperature=0.0, stop_at_eos=True)
    np.testing.assert_array_equal(stopped, [[EOS_ID]])
    _, to_word = sample.vocab_tables(VOCAB)
    text = sample.ids_to_text(tf.constant(went_on), to_word, eos_as_newline=True,
                              tokenizer="whitespace")
    assert text.numpy()[0].decode() == "\na\na\n"  # each sentence end is a line break


def test_a_diverged_row_ends_even_without_stop_at_eos():
    row = np.full(len(VOCAB), np.nan)
    out = run(FixedLogits(row), ["a", "b"], max_tokens=6, stop_at_eos=False)
    np.testing.assert_array_equal(out, [[EOS_ID], [EOS_ID]])


def test_max_tokens_bounds_the_continuation_and_zero_gives_nothing():
    model = FixedLogits(np.where(np.arange(len(VOCAB)) == EOS_ID, -50.0, 0.0))
    assert run(model, ["a"], max_tokens=3).shape == (1, 3)
    assert run(model, ["a", ""], max_tokens=0).shape == (2, 0)


def test_ids_to_text_drops_pad_and_eos():
    _, to_word = sample.vocab_tables(VOCAB)
    a, b = VOCAB.encode("a b")
    text = sample.ids_to_text(tf.constant([[a, b, EOS_ID, 0], [0, 0, 0, 0]]), to_word,
                              tokenizer="whitespace")
    assert [t.decode() for t in text.numpy()] == ["a b", ""]


def test_sampler_is_deterministic_and_returns_vocabulary_words():
    model = build_model(model_config(embed_dim=8, hidden_dim=8), len(VOCAB), seed=5)
    sampler = sample.Sampler(model, VOCAB)
    texts = sampler(["a b", ""], max_tokens=10, seed=3)
    assert texts == sampler(["a b", ""], max_tokens=10, seed=3)
    words = set(VOCAB.tokens[3:])
    for text in texts:
        assert len(text.split()) <= 10
        assert set(text.split()) <= words
