"""Tests of tfpar.data.synthetic: the generated language and its exact oracle."""

import collections
import dataclasses
import itertools
import math
import re
import time

import numpy as np
import pytest

from tfpar.data import synthetic
from tfpar.errors import ConfigError, DataError

# Small enough to enumerate every sentence (5 + 25 + 125) and every hidden path.
TINY = synthetic.SyntheticSpec(
    vocab_size=5,
    num_topics=2,
    num_syntax_states=2,
    median_length=2.0,
    max_length=3,
    train_sentences=10,
    valid_sentences=10,
    test_sentences=10,
)
SMALL = synthetic.SyntheticSpec(
    vocab_size=300, train_sentences=300, valid_sentences=50, test_sentences=50
)


@pytest.fixture(scope="module")
def default_corpus():
    """The default corpus and the seconds it took to generate."""
    start = time.perf_counter()
    corpus = synthetic.generate_corpus()
    return corpus, time.perf_counter() - start


@pytest.fixture(scope="module")
def default_source():
    return synthetic.SyntheticSource(synthetic.SyntheticSpec())


def _to_ids(lines, words):
    index = {word: i for i, word in enumerate(words)}
    return [np.array([index[w] for w in line.split()], np.int64) for line in lines]


def _enumerated_prob(source, sentence):
    """P(sentence) by summing over every topic and every syntax path explicitly."""
    total = 0.0
    num_states = len(source.initial)
    for topic in range(len(source.topic_prior)):
        for path in itertools.product(range(num_states), repeat=len(sentence)):
            p = source.topic_prior[topic] * source.initial[path[0]]
            p *= source.emission[topic, path[0], sentence[0]]
            for t in range(1, len(sentence)):
                p *= source.transition[path[t - 1], path[t]]
                p *= source.emission[topic, path[t], sentence[t]]
            total += p
    return source.length_probs[len(sentence)] * total


def _reference_log_prob(source, sentence):
    """log P(sentence) by an unscaled log-space forward pass over one sentence."""
    log_emission = np.log(source.emission)
    log_transition = np.log(source.transition)
    log_alpha = (
        np.log(source.topic_prior)[:, None]
        + np.log(source.initial)[None, :]
        + log_emission[:, :, sentence[0]]
    )
    for word in sentence[1:]:
        log_alpha = np.logaddexp.reduce(log_alpha[:, :, None] + log_transition, axis=1)
        log_alpha = log_alpha + log_emission[:, :, word]
    return np.log(source.length_probs[len(sentence)]) + np.logaddexp.reduce(log_alpha.ravel())


def _unigram_bigram_perplexity(train, valid, vocab_size, k):
    """Add-k unigram and bigram perplexities of ``valid``, with <eos> as a token.

    The bigram's context of a first word is <eos> (the previous sentence's end).

    Returns:
        (unigram perplexity, bigram perplexity, number of predicted tokens).
    """
    eos, size = vocab_size, vocab_size + 1

    def pairs(sentences):
        previous = np.concatenate([np.r_[eos, s] for s in sentences])
        following = np.concatenate([np.r_[s, eos] for s in sentences])
        return previous, following

    counts = np.zeros((size, size))
    np.add.at(counts, pairs(train), 1.0)
    bigram = (counts + k) / (counts.sum(axis=1, keepdims=True) + k * size)
    token_counts = counts.sum(axis=0)
    unigram = (token_counts + k) / (token_counts.sum() + k * size)
    previous, following = pairs(valid)
    unigram_ppl = math.exp(-np.log(unigram[following]).mean())
    bigram_ppl = math.exp(-np.log(bigram[previous, following]).mean())
    return unigram_ppl, bigram_ppl, len(following)


def test_generate_corpus_is_deterministic_in_the_spec():
    first = synthetic.generate_corpus(SMALL)
    second = synthetic.generate_corpus(SMALL)
    assert first == second
    reseeded = synthetic.generate_corpus(
        dataclasses.replace(SMALL, seed=1)
    )
    assert reseeded.train != first.train
    assert reseeded.valid != first.valid


def test_splits_are_independent_streams():
    corpus = synthetic.generate_corpus(SMALL)
    more_train = synthetic.generate_corpus(
        dataclasses.replace(SMALL, train_sentences=400)
    )
    assert more_train.valid == corpus.valid
    assert more_train.test == corpus.test
    assert corpus.train[:50] != corpus.valid
    assert corpus.valid != corpus.test
    assert [len(corpus.train), len(corpus.valid), len(corpus.test)] == [300, 50, 50]


def test_tiny_spec_really_mixes_topics_and_states():
    # Otherwise the enumeration tests below would not exercise the hidden variables.
    source = synthetic.SyntheticSource(TINY)
    assert not np.allclose(source.emission[0], source.emission[1])
    assert not np.allclose(source.emission[:, 0], source.emission[:, 1])


def test_log_prob_sums_to_one_over_every_sentence():
    source = synthetic.SyntheticSource(TINY)
    sentences = [
        np.array(words)
        for length in range(1, TINY.max_length + 1)
        for words in itertools.product(range(TINY.vocab_size), repeat=length)
    ]
    assert len(sentences) == 5 + 25 + 125
    total = np.exp(source.log_prob(sentences)).sum()
    assert total == pytest.approx(1.0, abs=1e-9)


def test_log_prob_matches_enumeration_of_hidden_paths():
    source = synthetic.SyntheticSource(TINY)
    sentences = [np.array([3]), np.array([0, 4]), np.array([2, 2, 1]), np.array([4, 0, 3])]
    expected = [math.log(_enumerated_prob(source, s)) for s in sentences]
    np.testing.assert_allclose(source.log_prob(sentences), expected, rtol=1e-12)


def test_log_prob_matches_log_space_forward_on_mixed_lengths():
    spec = synthetic.SyntheticSpec(vocab_size=50, num_topics=3, num_syntax_states=4)
    source = synthetic.SyntheticSource(spec)
    sentences = source.sample(40, np.random.default_rng(7))
    assert len({len(s) for s in sentences}) > 10
    expected = [_reference_log_prob(source, s) for s in sentences]
    np.testing.assert_allclose(source.log_prob(sentences), expected, rtol=1e-10)


def test_sampler_draws_from_the_distribution_it_scores():
    source = synthetic.SyntheticSource(TINY)
    num_samples = 200_000
    samples = source.sample(num_samples, np.random.default_rng(3))
    counts = collections.Counter(tuple(s.tolist()) for s in samples)
    sentences = [np.array(key) for key in counts]
    expected = np.exp(source.log_prob(sentences)) * num_samples
    observed = np.array(list(counts.values()))
    # Five standard deviations of a binomial count, per sentence.
    assert np.all(np.abs(observed - expected) <= 5 * np.sqrt(expected) + 1)
    assert np.exp(source.log_prob(sentences)).sum() > 0.999


def test_sample_returns_int32_sentences_within_bounds():
    source = synthetic.SyntheticSource(SMALL)
    sentences = source.sample(500, np.random.default_rng(0))
    assert len(sentences) == 500
    assert all(s.dtype == np.int32 and s.ndim == 1 for s in sentences)
    assert all(1 <= len(s) <= SMALL.max_length for s in sentences)
    flat = np.concatenate(sentences)
    assert flat.min() >= 0 and flat.max() < SMALL.vocab_size
    assert source.sample(0, np.random.default_rng(0)) == []


def test_log_prob_of_impossible_lengths_is_minus_infinity():
    source = synthetic.SyntheticSource(TINY)
    log_probs = source.log_prob([np.array([], np.int64), np.array([1, 2, 3, 4]), np.array([1])])
    assert log_probs[0] == -np.inf
    assert log_probs[1] == -np.inf
    assert np.isfinite(log_probs[2])


def test_log_prob_rejects_word_indices_outside_the_vocabulary():
    source = synthetic.SyntheticSource(TINY)
    message = "sentence 1 has word index 5 at position 2; must be in [0, 5)"
    with pytest.raises(DataError, match=re.escape(message)):
        source.log_prob([np.array([0]), np.array([0, 1, 5])])
    with pytest.raises(DataError, match=r"sentence 0 has word index -1 at position 0"):
        source.log_prob([np.array([-1])])


def test_words_are_distinct_lowercase_pseudo_words(default_source):
    words = default_source.words
    assert len(words) == 2000
    assert len(set(words)) == 2000
    assert all(re.fullmatch(r"[a-z]+", w) for w in words)
    # Frequent words are short: the first 480 are single syllables.
    assert max(len(w) for w in words[:480]) <= 4
    # A word's spelling does not depend on the seed or the vocabulary size.
    other = synthetic.SyntheticSource(synthetic.SyntheticSpec(vocab_size=300, seed=5))
    assert other.words == words[:300]


def test_sentence_text_joins_words_with_single_spaces(default_source):
    words = default_source.words
    text = default_source.sentence_text(np.array([0, 7, 1], np.int32))
    assert text == f"{words[0]} {words[7]} {words[1]}"
    assert default_source.sentence_text([2]) == words[2]


def test_parameters_are_normalised_and_read_only(default_source):
    source = default_source
    assert source.length_probs.shape == (81,)
    assert source.emission.shape == (8, 10, 2000)
    assert source.transition.shape == (10, 10)
    np.testing.assert_allclose(source.length_probs.sum(), 1.0, rtol=1e-12)
    np.testing.assert_allclose(source.emission.sum(axis=2), 1.0, rtol=1e-12)
    np.testing.assert_allclose(source.transition.sum(axis=1), 1.0, rtol=1e-12)
    assert source.topic_prior.sum() == pytest.approx(1.0)
    assert source.initial.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        source.emission[0, 0, 0] = 1.0


def test_oracle_scores_are_the_log_probs_of_the_split_texts(default_corpus, default_source):
    corpus, _ = default_corpus
    sentences = _to_ids(corpus.valid, default_source.words)
    assert corpus.oracle_tokens["valid"] == sum(len(s) + 1 for s in sentences)
    nll = -default_source.log_prob(sentences).sum()
    assert corpus.oracle_nll["valid"] == pytest.approx(nll, rel=1e-12)
    assert corpus.oracle_perplexity("valid") == pytest.approx(
        math.exp(nll / corpus.oracle_tokens["valid"])
    )
    assert set(corpus.oracle_nll) == set(corpus.oracle_tokens) == {"train", "valid", "test"}


def test_oracle_perplexity_rejects_unknown_split(default_corpus):
    corpus, _ = default_corpus
    with pytest.raises(DataError, match=r"unknown split 'dev'; must be one of test, train, valid"):
        corpus.oracle_perplexity("dev")


def test_default_sentence_lengths_spread_like_text(default_corpus):
    corpus, _ = default_corpus
    lengths = np.array([len(line.split()) for line in corpus.train])
    assert len(lengths) == 20000
    assert 17 <= np.median(lengths) <= 23
    assert lengths.min() >= 1
    assert lengths.max() <= 80
    # A long right tail, as in real text.
    assert np.percentile(lengths, 95) > 1.8 * np.median(lengths)
    assert all("  " not in line and line == line.strip() for line in corpus.train[:100])


def test_default_unigram_frequencies_are_zipfian(default_corpus):
    corpus, _ = default_corpus
    counts = collections.Counter(w for line in corpus.train for w in line.split())
    frequencies = np.array(sorted(counts.values(), reverse=True), np.float64)
    ranks = np.arange(1, len(frequencies) + 1)
    window = slice(9, 500)
    slope = np.polyfit(np.log(ranks[window]), np.log(frequencies[window]), 1)[0]
    assert -1.5 < slope < -0.6


def test_default_oracle_beats_bigram_and_unigram(default_corpus, default_source):
    corpus, _ = default_corpus
    train = _to_ids(corpus.train, default_source.words)
    valid = _to_ids(corpus.valid, default_source.words)
    unigram, bigram, tokens = _unigram_bigram_perplexity(train, valid, 2000, k=0.03)
    oracle = corpus.oracle_perplexity("valid")
    assert tokens == corpus.oracle_tokens["valid"]
    # Measured at seed 0: oracle ~63, bigram ~166, unigram ~468.
    assert 40 < oracle < 120
    assert bigram > 1.5 * oracle
    assert unigram > 3 * oracle


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "vocab_size",
            1,
            "SyntheticSpec.vocab_size=1 is invalid: must be an integer in [2, 100000]",
        ),
        ("vocab_size", 100_001, "SyntheticSpec.vocab_size=100001 is invalid"),
        ("vocab_size", 20.0, "SyntheticSpec.vocab_size=20.0 is invalid: must be an integer"),
        ("num_topics", 0, "SyntheticSpec.num_topics=0 is invalid: must be an integer in [1, 64]"),
        ("num_topics", 65, "SyntheticSpec.num_topics=65 is invalid"),
        (
            "num_syntax_states",
            0,
            "SyntheticSpec.num_syntax_states=0 is invalid: must be an integer in [1, 64]",
        ),
        ("max_length", 0, "SyntheticSpec.max_length=0 is invalid: must be an integer in [1, 1000]"),
        ("max_length", 1001, "SyntheticSpec.max_length=1001 is invalid"),
        (
            "median_length",
            0.5,
            "SyntheticSpec.median_length=0.5 is invalid: must be a number in [1, max_length=80]",
        ),
        ("median_length", 81.0, "SyntheticSpec.median_length=81.0 is invalid"),
        ("median_length", float("nan"), "SyntheticSpec.median_length=nan is invalid"),
        ("median_length", "20", "SyntheticSpec.median_length='20' is invalid"),
        (
            "train_sentences",
            0,
            "SyntheticSpec.train_sentences=0 is invalid: must be an integer in [1, 10000000]",
        ),
        ("valid_sentences", -3, "SyntheticSpec.valid_sentences=-3 is invalid"),
        ("test_sentences", True, "SyntheticSpec.test_sentences=True is invalid"),
        (
            "seed",
            -1,
            "SyntheticSpec.seed=-1 is invalid: must be an integer in [0, 9223372036854775807]",
        ),
    ],
)
def test_spec_rejects_bad_values(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        synthetic.SyntheticSpec(**{field: value})


def test_median_length_range_follows_max_length():
    with pytest.raises(ConfigError, match=re.escape("must be a number in [1, max_length=10]")):
        synthetic.SyntheticSpec(max_length=10, median_length=10.5)
    assert synthetic.SyntheticSpec(max_length=10, median_length=10).median_length == 10
