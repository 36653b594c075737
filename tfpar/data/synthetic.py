"""The generated default corpus and its exact oracle log-probabilities.

tfpar's default corpus (``--data synthetic``) is drawn from a stochastic source that
tfpar builds itself from a seed, so every run can report the *oracle perplexity* (the
perplexity of the true source) next to the model's. The source is a small language:

* **Words.** ``vocab_size`` pronounceable pseudo-words ("ka", "lomtre", ...), lower-case
  ASCII, all distinct. Word index ``i`` is frequency rank ``i``: frequent words are
  short, as in real languages. Base weights follow Zipf-Mandelbrot,
  ``zipf(w) = (w + 2.7) ** -1``.
* **Length.** ``L`` is a log-normal with median ``median_length``, discretised to the
  nearest integer and truncated (renormalised) to ``[1, max_length]``. It is drawn
  first and is independent of the words.
* **Words given the length.** A factorial hidden Markov model. One *topic*
  ``k ~ prior`` is drawn per sentence and kept; a *syntax* state follows a Markov chain
  ``s_1 ~ initial``, ``s_t ~ transition[s_{t-1}]``; each word is emitted from
  ``emission[k, s_t]``, where ``emission[k, s, w] ∝ zipf(w) * member[s, w] *
  boost[k, s, w]``. Each syntax state owns a few hundred words (a word can belong to
  two states, so a word does not reveal its state); content words have a home topic
  that boosts them strongly in content states. A bigram sees the syntax but forgets
  the topic; a recurrent model can infer the topic from the words so far.

The probability of a sentence, as a language model sees it, is therefore::

    P(w_1 .. w_L <eos>) = P(L) * P_hmm(w_1 .. w_L)

where ``P_hmm`` is the HMM's probability of a length-``L`` prefix (the HMM itself never
stops; summed over all word strings of one length it is 1). In a language model's
left-to-right factorisation the length model is a hazard: after ``t`` words,
``p(<eos>) = h(t) = P(L = t) / P(L >= t)`` and every word carries a factor ``1 - h(t)``;
the product telescopes to ``P(L)``. ``log_prob`` computes ``log P(L)`` plus
``log P_hmm`` with the scaled forward algorithm, vectorised over sentences.

A sentence of ``L`` words is ``L + 1`` predicted tokens (its words and one ``<eos>``),
so the oracle perplexity of a split is
``exp(-sum(log_prob) / sum(L + 1))``. No model can beat it in expectation; on a finite
split a model can undercut it only by sampling noise.
"""

import dataclasses
import math

import numpy as np

from tfpar.errors import ConfigError, DataError

# Zipf-Mandelbrot weights (rank + offset) ** -exponent: the offset flattens the head
# the way real word counts do (the top words of English are not 1/2/3 apart).
_ZIPF_EXPONENT = 1.0
_ZIPF_OFFSET = 2.7
# Log-normal sentence length: sigma 0.55 around a median of 20 gives a mean of ~23 and a
# standard deviation of ~13, close to newswire sentences.
_LENGTH_SIGMA = 0.55
# Grammar: each syntax state has its successor on a random cycle through all states
# (so every state is reachable) plus a few random likely successors; every other
# transition keeps a little probability.
_EXTRA_SUCCESSORS = 2
_SUCCESSOR_CONCENTRATION = 0.5
_TRANSITION_FLOOR = 0.02
# Sentences open with a few kinds of word; topics are unequal but all common.
_INITIAL_CONCENTRATION = 0.5
_TOPIC_PRIOR_CONCENTRATION = 4.0
# Fraction of words that also belong to a second syntax state, and the weight of that
# second membership relative to the first; ambiguity is what makes the state hidden.
_SECOND_STATE_FRACTION = 0.3
_SECOND_STATE_WEIGHT = 0.5
# Every word keeps a little weight in every state, so every sentence over the
# vocabulary has a finite log-probability.
_MEMBER_FLOOR = 1e-3
# The most frequent 1.5% of words (30 of 2000) are function words: they have no topic.
_FUNCTION_WORD_FRACTION = 0.015
# Multiplier of a content word in its home topic, at full topic strength. Topic
# strength per syntax state is uniform in [_MIN_TOPIC_STRENGTH, 1]: determiners care
# less about the topic than nouns do.
_TOPIC_BOOST = 100.0
_MIN_TOPIC_STRENGTH = 0.5
# Pseudo-word syllables: onset + vowel + optional coda (480 syllables; over 100,000
# distinct two-syllable words, enough for the largest vocab_size). Words are shuffled
# with a fixed seed, so a word's spelling changes with neither ``SyntheticSpec.seed``
# nor ``vocab_size``: a smaller vocabulary is a prefix of a larger one.
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "tr", "st")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "m", "n", "l", "r", "s")
_WORD_SEED = 20240531
# Independent random streams derived from SyntheticSpec.seed. Fixed keys (not spawn
# order) so adding a stream never changes the others, and the valid and test splits
# do not change when train_sentences does.
_STREAM_KEYS = {"parameters": 0, "train": 1, "valid": 2, "test": 3}
_SPLITS = ("train", "valid", "test")
# A cap that catches typos: 10M sentences is already ~1.5 GB of Python strings.
_MAX_SENTENCES = 10_000_000


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """The generated language and how much of it to draw.

    Raises:
        ConfigError: if a field is not an integer (a number for ``median_length``) in
            its allowed range.
    """

    # Number of distinct words; word i has Zipf rank i. In [2, 100000].
    vocab_size: int = 2000
    # Topics; one is drawn per sentence and kept for the whole sentence. In [1, 64].
    num_topics: int = 8
    # States of the syntax Markov chain that runs within a sentence. In [1, 64].
    num_syntax_states: int = 10
    # Median sentence length in words (before truncation). In [1, max_length].
    median_length: float = 20.0
    # Longest sentence in words, without <eos>. In [1, 1000].
    max_length: int = 80
    # Sentences in the training split. In [1, 10000000].
    train_sentences: int = 20000
    # Sentences in the validation split. In [1, 10000000].
    valid_sentences: int = 2000
    # Sentences in the test split. In [1, 10000000].
    test_sentences: int = 2000
    # Seeds the source's parameters and the three splits. In [0, 2**63 - 1].
    seed: int = 0

    def __post_init__(self):
        _check_int("vocab_size", self.vocab_size, 2, 100_000)
        _check_int("num_topics", self.num_topics, 1, 64)
        _check_int("num_syntax_states", self.num_syntax_states, 1, 64)
        _check_int("max_length", self.max_length, 1, 1000)
        _check_median(self.median_length, self.max_length)
        _check_int("train_sentences", self.train_sentences, 1, _MAX_SENTENCES)
        _check_int("valid_sentences", self.valid_sentences, 1, _MAX_SENTENCES)
        _check_int("test_sentences", self.test_sentences, 1, _MAX_SENTENCES)
        _check_int("seed", self.seed, 0, 2**63 - 1)


def _check_int(name, value, low, high):
    # bool is an int subclass, but True sentences is a typo, not a request.
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not is_int or not low <= value <= high:
        raise ConfigError(
            f"SyntheticSpec.{name}={value!r} is invalid: must be an integer in [{low}, {high}]"
        )


def _check_median(value, max_length):
    is_number = isinstance(value, (int, float, np.integer, np.floating))
    # The negated comparison also rejects NaN.
    if isinstance(value, bool) or not is_number or not 1 <= value <= max_length:
        raise ConfigError(
            f"SyntheticSpec.median_length={value!r} is invalid: "
            f"must be a number in [1, max_length={max_length}]"
        )


class SyntheticSource:
    """The stochastic source: samples sentences and scores them exactly.

    All parameters are built from ``spec.seed``: equal specs give identical sources.
    Arrays are read-only. ``K`` is ``num_topics``, ``S`` ``num_syntax_states``, ``V``
    ``vocab_size``.

    Attributes:
        spec: The ``SyntheticSpec`` this source was built from.
        words: ``V`` word strings; index ``i`` is the word of rank ``i``.
        length_probs: ``[max_length + 1]`` float64, ``P(L = l)``; entry 0 is 0.
        topic_prior: ``[K]`` float64, the topic distribution of a sentence.
        initial: ``[S]`` float64, the syntax state of the first word.
        transition: ``[S, S]`` float64, ``P(s_t = j | s_{t-1} = i)`` at ``[i, j]``.
        emission: ``[K, S, V]`` float64, ``P(w | topic, syntax state)``.
    """

    def __init__(self, spec: SyntheticSpec):
        self.spec = spec
        rng = _stream(spec.seed, "parameters")
        num_topics, num_states = spec.num_topics, spec.num_syntax_states
        self.words = _pseudo_words(spec.vocab_size)
        self.length_probs = _frozen(_length_probs(spec.median_length, spec.max_length))
        self.topic_prior = _frozen(
            rng.dirichlet(np.full(num_topics, _TOPIC_PRIOR_CONCENTRATION))
        )
        self.initial = _frozen(rng.dirichlet(np.full(num_states, _INITIAL_CONCENTRATION)))
        self.transition = _frozen(_transitions(rng, num_states))
        self.emission = _frozen(_emissions(rng, num_topics, num_states, spec.vocab_size))
        # Forward pass gathers one [K, S] slice per token: keep it contiguous.
        self._emission_by_word = np.ascontiguousarray(self.emission.transpose(2, 0, 1))
        # Row g = k * S + s of the emission CDFs, shifted by g so one sorted array
        # serves every (topic, state) pair in a single searchsorted.
        cdf = np.cumsum(self.emission.reshape(num_topics * num_states, -1), axis=1)
        cdf[:, -1] = 1.0
        self._shifted_cdf = (cdf + np.arange(len(cdf))[:, None]).ravel()

    def sample(self, n: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Draws sentences from the source.

        Args:
            n: Number of sentences, ``>= 0``.
            rng: The random stream to draw from (advanced in place).

        Returns:
            ``n`` int32 arrays of word indices, ``[L_i]`` each, without ``<eos>``.
        """
        lengths = rng.choice(
            np.arange(len(self.length_probs)), size=n, p=self.length_probs
        )
        topics = rng.choice(len(self.topic_prior), size=n, p=self.topic_prior)
        states = self._sample_states(lengths, rng)
        mask = np.arange(states.shape[1]) < lengths[:, None]
        groups = (topics[:, None] * len(self.initial) + states)[mask]
        words = self._sample_words(groups, rng)
        return np.split(words, np.cumsum(lengths)[:-1]) if n else []

    def _sample_states(self, lengths, rng):
        """Syntax paths, ``[n, max(lengths)]`` int64; entries past a length are junk."""
        num_steps = int(lengths.max(initial=0))
        states = np.zeros((len(lengths), num_steps), np.int64)
        if num_steps == 0:
            return states
        cdf = np.cumsum(self.transition, axis=1)
        states[:, 0] = rng.choice(len(self.initial), size=len(lengths), p=self.initial)
        for t in range(1, num_steps):
            u = rng.random(len(lengths))
            # Inverse CDF: the first state whose cumulative probability exceeds u.
            nxt = (cdf[states[:, t - 1]] <= u[:, None]).sum(axis=1)
            states[:, t] = np.minimum(nxt, len(self.initial) - 1)
        return states

    def _sample_words(self, groups, rng):
        """One word per token from ``emission`` row ``groups`` (``k * S + s``)."""
        vocab_size = len(self.words)
        u = rng.random(len(groups))
        flat = np.searchsorted(self._shifted_cdf, groups + u, side="right")
        words = np.clip(flat - groups * vocab_size, 0, vocab_size - 1)
        return words.astype(np.int32)

    def log_prob(self, sentences: list[np.ndarray]) -> np.ndarray:
        """Exact natural-log probability of each sentence, including its length.

        Args:
            sentences: Arrays (or lists) of word indices, ``[L_i]`` each, no ``<eos>``.

        Returns:
            ``[n]`` float64, ``log P(L_i) + log P_hmm(sentence_i)``; ``-inf`` for a
            length outside ``[1, max_length]``.

        Raises:
            DataError: if a word index is outside ``[0, vocab_size)``.
        """
        lengths = np.array([len(s) for s in sentences], np.int64)
        words = self._padded(sentences, lengths)
        valid = (lengths >= 1) & (lengths < len(self.length_probs))
        out = np.full(len(sentences), -np.inf)
        with np.errstate(divide="ignore"):
            log_length = np.log(self.length_probs)
        out[valid] = log_length[lengths[valid]] + self._forward(
            words[valid], lengths[valid]
        )
        return out

    def _padded(self, sentences, lengths):
        """Word indices as ``[n, max(L)]`` int64, zero-padded, range-checked."""
        words = np.zeros((len(sentences), int(lengths.max(initial=0))), np.int64)
        for i, sentence in enumerate(sentences):
            words[i, : lengths[i]] = sentence
        bad = (words < 0) | (words >= len(self.words))
        if bad.any():
            row, col = np.argwhere(bad)[0]
            raise DataError(
                f"sentence {row} has word index {words[row, col]} at position {col}; "
                f"must be in [0, {len(self.words)})"
            )
        return words

    def _forward(self, words, lengths):
        """Scaled forward algorithm: ``log P_hmm`` of each row of ``words``.

        Args:
            words: ``[n, T]`` int64 word indices, padded past each length.
            lengths: ``[n]`` int64, each in ``[1, T]``.

        Returns:
            ``[n]`` float64 log-probabilities.
        """
        # Longest first, so the sentences still running at step t are a prefix.
        order = np.argsort(-lengths, kind="stable")
        words, lengths = words[order], lengths[order]
        # still_running[t] = number of sentences longer than t words.
        still_running = np.searchsorted(-lengths, -np.arange(words.shape[1]), side="left")
        # alpha[i, k, s] = P(topic k, state s | words so far), with the probability of
        # the words so far kept apart in log_total, so nothing underflows.
        alpha = self.topic_prior[:, None] * self.initial[None, :]
        num_topics, num_states = alpha.shape
        alpha = np.broadcast_to(alpha, (len(lengths), num_topics, num_states))
        log_total = np.zeros(len(lengths))
        for t in range(words.shape[1]):
            n = still_running[t]
            if t > 0:
                # One [n * K, S] @ [S, S] product: much faster than a stacked matmul.
                alpha = alpha[:n].reshape(n * num_topics, num_states) @ self.transition
                alpha = alpha.reshape(n, num_topics, num_states)
            alpha = alpha[:n] * self._emission_by_word[words[:n, t]]
            scale = alpha.sum(axis=(1, 2))
            log_total[:n] += np.log(scale)
            alpha = alpha / scale[:, None, None]
        out = np.empty_like(log_total)
        out[order] = log_total
        return out

    def sentence_text(self, sentence) -> str:
        """The words of ``sentence`` (word indices) joined by single spaces."""
        # tolist() first: indexing a list with Python ints is several times faster.
        return " ".join([self.words[i] for i in np.asarray(sentence).tolist()])


@dataclasses.dataclass(frozen=True)
class SyntheticCorpus:
    """Three splits of generated text and their oracle scores.

    Keys of the dicts are ``"train"``, ``"valid"`` and ``"test"``.
    """

    # One sentence per string, words separated by one space, no <eos>.
    train: list[str]
    valid: list[str]
    test: list[str]
    # Split -> total negative log-likelihood (nats) of the split under the source.
    oracle_nll: dict[str, float]
    # Split -> predicted tokens: words plus one <eos> per sentence.
    oracle_tokens: dict[str, int]

    def oracle_perplexity(self, split: str) -> float:
        """``exp(oracle_nll / oracle_tokens)`` of ``split``.

        Raises:
            DataError: if ``split`` is not one of the corpus's splits.
        """
        if split not in self.oracle_nll:
            raise DataError(
                f"unknown split {split!r}; must be one of {', '.join(sorted(self.oracle_nll))}"
            )
        return math.exp(self.oracle_nll[split] / self.oracle_tokens[split])


def generate_corpus(spec: SyntheticSpec = SyntheticSpec()) -> SyntheticCorpus:
    """Draws the train, valid and test splits of ``spec`` and scores them.

    Deterministic in ``spec``. Each split comes from its own stream derived from
    ``spec.seed``, so e.g. the valid split does not change with ``train_sentences``.
    """
    source = SyntheticSource(spec)
    sizes = {
        "train": spec.train_sentences,
        "valid": spec.valid_sentences,
        "test": spec.test_sentences,
    }
    texts, nll, tokens = {}, {}, {}
    for split in _SPLITS:
        sentences = source.sample(sizes[split], _stream(spec.seed, split))
        texts[split] = [source.sentence_text(s) for s in sentences]
        nll[split] = float(-source.log_prob(sentences).sum())
        tokens[split] = sum(len(s) + 1 for s in sentences)
    return SyntheticCorpus(**texts, oracle_nll=nll, oracle_tokens=tokens)


def _stream(seed, name):
    """The random generator of stream ``name`` (see ``_STREAM_KEYS``) of ``seed``."""
    return np.random.default_rng(
        np.random.SeedSequence(seed, spawn_key=(_STREAM_KEYS[name],))
    )


def _frozen(array):
    array.setflags(write=False)
    return array


def _zipf(vocab_size):
    """``[V]`` Zipf-Mandelbrot weights by rank (unnormalised)."""
    return (np.arange(vocab_size) + _ZIPF_OFFSET) ** -_ZIPF_EXPONENT


def _length_probs(median, max_length):
    """``[max_length + 1]`` pmf of the discretised, truncated log-normal length."""
    # Length l takes the continuous mass of [l - 0.5, l + 0.5); length 1 also takes
    # (0, 0.5), and mass beyond max_length + 0.5 is dropped and renormalised away.
    edges = np.arange(max_length + 1) + 0.5
    z = (np.log(edges) - math.log(median)) / _LENGTH_SIGMA
    cdf = np.array([0.5 * math.erfc(-x / math.sqrt(2.0)) for x in z])
    probs = np.diff(cdf, prepend=0.0) / cdf[-1]
    probs[0] = 0.0
    probs[1] = cdf[1] / cdf[-1]
    return probs


def _transitions(rng, num_states):
    """``[S, S]`` syntax transition matrix, rows normalised."""
    cycle = rng.permutation(num_states)
    successors = np.empty((num_states, 1 + _EXTRA_SUCCESSORS), np.int64)
    successors[cycle, 0] = np.roll(cycle, -1)
    for j in range(1, 1 + _EXTRA_SUCCESSORS):
        # Permutations give every state the same in-degree, so no state hoards the
        # stationary mass and leaves the others' words unused.
        successors[:, j] = rng.permutation(num_states)
    weights = rng.dirichlet(
        np.full(1 + _EXTRA_SUCCESSORS, _SUCCESSOR_CONCENTRATION), size=num_states
    )
    transition = np.zeros((num_states, num_states))
    # add.at, not assignment: a successor drawn twice gets both weights.
    np.add.at(transition, (np.arange(num_states)[:, None], successors), weights)
    return (1.0 - _TRANSITION_FLOOR) * transition + _TRANSITION_FLOOR / num_states


def _emissions(rng, num_topics, num_states, vocab_size):
    """``[K, S, V]`` emission distributions, each row normalised."""
    member = _membership(rng, num_states, vocab_size)
    boost = _topic_boost(rng, num_topics, num_states, vocab_size)
    weights = _zipf(vocab_size) * member[None, :, :] * boost
    return weights / weights.sum(axis=2, keepdims=True)


def _membership(rng, num_states, vocab_size):
    """``[S, V]`` weight of each word in each syntax state (a soft part of speech)."""
    # Unequal class sizes, like nouns versus determiners.
    share = rng.dirichlet(np.full(num_states, 2.0))
    primary = rng.choice(num_states, size=vocab_size, p=share)
    secondary = rng.choice(num_states, size=vocab_size)
    has_second = rng.random(vocab_size) < _SECOND_STATE_FRACTION
    member = np.full((num_states, vocab_size), _MEMBER_FLOOR)
    columns = np.arange(vocab_size)
    member[secondary[has_second], columns[has_second]] = _SECOND_STATE_WEIGHT
    member[primary, columns] = 1.0
    return member


def _topic_boost(rng, num_topics, num_states, vocab_size):
    """``[K, S, V]`` multiplier of each word by topic and syntax state."""
    home = rng.choice(num_topics, size=vocab_size)
    is_home = np.arange(num_topics)[:, None] == home[None, :]
    is_home[:, : round(_FUNCTION_WORD_FRACTION * vocab_size)] = False
    strength = rng.uniform(_MIN_TOPIC_STRENGTH, 1.0, size=num_states)
    log_boost = math.log(_TOPIC_BOOST) * strength[None, :, None] * is_home[:, None, :]
    return np.exp(log_boost)


def _pseudo_words(vocab_size):
    """``vocab_size`` distinct pseudo-words: the 480 monosyllables, then two syllables."""
    syllables = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    rng = np.random.default_rng(_WORD_SEED)
    words, seen = [], set()
    for num_syllables in (1, 2):
        for code in rng.permutation(len(syllables) ** num_syllables):
            word = _spell(int(code), num_syllables, syllables)
            # Different syllable splits can spell the same word ("kat"+"ra", "ka"+"tra").
            if word not in seen:
                seen.add(word)
                words.append(word)
            if len(words) == vocab_size:
                return words
    raise AssertionError(f"only {len(words)} pseudo-words exist; vocab_size is capped below")


def _spell(code, num_syllables, syllables):
    """The word whose syllables are the base-``len(syllables)`` digits of ``code``."""
    parts = []
    for _ in range(num_syllables):
        code, digit = divmod(code, len(syllables))
        parts.append(syllables[digit])
    return "".join(parts)
