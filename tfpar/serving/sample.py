"""Text generation in TF ops: prompt → continuation, one token at a time.

Used in two places: the SavedModel's ``generate`` signature (so serving needs no Python
and no tfpar) and the text samples TensorBoard shows after every epoch. Everything here
runs inside a ``tf.function``::

    prompt "the cat"   →  ids  <eos> the cat <pad> <pad>      (split by the model's
                                                               tokenizer, right-padded to
                                                               the batch's longest prompt;
                                                               length 3)
    run the model on the padded prompt: the embedding's mask carries the RNN state over the
    padding, so each row's final state is the state after its own last word, and its
    next-token logits are the ones at position length - 1;
    then, up to ``max_tokens`` times:  pick a token → append → feed it with the state.

With ``stop_at_eos`` a row stops at its first ``<eos>`` (which is not part of the text);
without it (the ``generate`` script's and signature's usual choice) the ``<eos>`` is fed
back like any word, the row goes on into the next sentence, and the text shows each
``<eos>`` as a line break (a ``char`` model's text thus runs over several lines; its
characters are joined with nothing, other tokenizers' tokens with spaces). ``<pad>`` and
``<unk>`` are never picked; a row whose scores are not finite (a diverged model) stops at
once. The output text is the continuation only, without the prompt.

Token choice: greedy (argmax) when ``temperature <= 0`` or ``top_k == 1``; otherwise a draw
from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens
(``top_k <= 0``: all tokens), by ``tf.random.stateless_categorical`` seeded with
``(seed, step)``. So the same seed, prompts and weights always give the same text.
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.data.pipeline import tokenize
from tfpar.data.tokenize import join_tokens
from tfpar.data.vocab import EOS_ID, PAD_ID, UNK_ID, Vocab

# Ids generation never produces.
NEVER_SAMPLED = (PAD_ID, UNK_ID)


def word_ids(lines: tf.Tensor, table, *, tokenizer: str) -> tf.RaggedTensor:
    """[B] strings → [B, (n_i)] int32 ids, split by ``tokenizer`` as in training.

    A literal ``<pad>`` in the text is a word the model never saw, so it becomes ``<unk>``
    (as in the input pipeline) rather than id 0, which would be read as padding.
    """
    ids = tokenize(lines, table, tokenizer=tokenizer)
    return tf.ragged.map_flat_values(
        lambda v: tf.where(tf.equal(v, PAD_ID), tf.constant(UNK_ID, v.dtype), v), ids)


def prompt_ids(prompts: tf.Tensor, table, *, tokenizer: str) -> tuple[tf.Tensor, tf.Tensor]:
    """[B] prompt strings → (``<eos>`` + prompt ids [B, P] int32 right-padded with 0,
    lengths [B] int32 counting the ``<eos>``), split by ``tokenizer``."""
    ids = word_ids(prompts, table, tokenizer=tokenizer)
    eos = tf.RaggedTensor.from_tensor(tf.fill([ids.nrows(), 1], EOS_ID))
    full = tf.concat([eos, ids], axis=1)
    return full.to_tensor(default_value=PAD_ID), tf.cast(full.row_lengths(), tf.int32)


def choose_tokens(logits: tf.Tensor, step: tf.Tensor, *, temperature: tf.Tensor,
                  top_k: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Picks the next token of every row.

    Args:
      logits: [B, V] next-token scores.
      step: int32 scalar, the position in the continuation (part of the random seed).
      temperature: float32 scalar; <= 0 means greedy.
      top_k: int32 scalar; keep the k most likely tokens (<= 0: all; 1: greedy).
      seed: int32 scalar.

    Returns:
      [B] int32 token ids, never ``<pad>`` or ``<unk>``; ``<eos>`` where a row's scores
      are not all finite.
    """
    logits = tf.cast(logits, tf.float32)
    vocab_size = tf.shape(logits)[1]
    banned = tf.reduce_any(
        tf.equal(tf.range(vocab_size)[:, None], tf.constant(NEVER_SAMPLED)[None, :]), axis=1)
    neg_inf = tf.constant(-float("inf"))

    def greedy():
        return tf.argmax(tf.where(banned[None, :], neg_inf, logits), axis=1,
                         output_type=tf.int32)

    def sample():
        # Banned tokens go first, so they never take one of the k places from a word.
        # With k above the allowed count the k-th value is -inf and nothing more is cut.
        scaled = tf.where(banned[None, :], neg_inf, logits / temperature)
        k = tf.minimum(top_k, vocab_size)
        scaled = tf.cond(
            k > 0,
            lambda: tf.where(scaled < tf.math.top_k(scaled, k=k).values[:, -1:], neg_inf, scaled),
            lambda: scaled,
        )
        draw = tf.random.stateless_categorical(
            scaled, 1, seed=tf.stack([seed, step]), dtype=tf.int32)
        return draw[:, 0]

    is_greedy = tf.logical_or(temperature <= 0.0, tf.equal(top_k, 1))
    token = tf.cond(is_greedy, greedy, sample)
    # A diverged model (inf/NaN scores) has no distribution to draw from: there the draw
    # returns vocab_size (an id outside the vocabulary) and argmax returns <pad>. Such a
    # row ends at once with <eos> instead.
    usable = tf.reduce_all(tf.logical_or(tf.math.is_finite(logits), banned[None, :]), axis=1)
    usable = tf.logical_and(usable, tf.logical_and(token >= 0, token < vocab_size))
    return tf.where(usable, token, EOS_ID)


def generate_ids(model, prompt: tf.Tensor, lengths: tf.Tensor, *, max_tokens: tf.Tensor,
                 temperature: tf.Tensor, top_k: tf.Tensor, seed: tf.Tensor,
                 stop_at_eos=True) -> tf.Tensor:
    """Continues every prompt; see the module docstring.

    Args:
      model: an ``RNNLanguageModel`` (``call(inputs, initial_state) -> (logits, state)``).
      prompt: [B, P] int32, ``<eos>`` + prompt ids, right-padded with 0.
      lengths: [B] int32, real tokens of each prompt row (>= 1).
      max_tokens: int32 scalar, the most tokens generated per row (``<eos>`` included).
      temperature, top_k, seed: see :func:`choose_tokens`.
      stop_at_eos: bool scalar; True: a row ends at its first ``<eos>``; False: the
        ``<eos>`` is fed back like any token and the row goes on into the next sentence
        (only ``max_tokens`` or non-finite scores end it).

    Returns:
      [B, N] int32 generated ids, N <= max_tokens; a row that ended early holds its
      ``<eos>`` then 0 (padding).
    """
    logits, state = model(prompt, training=False)
    last = tf.gather(logits, lengths - 1, axis=1, batch_dims=1)  # [B, V]
    batch = tf.shape(prompt)[0]
    done = tf.zeros([batch], tf.bool)
    out = tf.zeros([batch, 0], tf.int32)

    def keep_going(i, _logits, _state, done, _out):
        return tf.logical_and(i < max_tokens, tf.logical_not(tf.reduce_all(done)))

    def step(i, logits, state, done, out):
        token = choose_tokens(logits, i, temperature=temperature, top_k=top_k, seed=seed)
        token = tf.where(done, PAD_ID, token)  # A finished row only pads; 0 also masks it.
        out = tf.concat([out, token[:, None]], axis=1)
        # A diverged row (non-finite scores: choose_tokens gave it <eos>) always ends.
        diverged = tf.logical_not(tf.reduce_all(
            tf.math.is_finite(tf.cast(logits, tf.float32)), axis=-1))
        ended = tf.logical_or(diverged, tf.logical_and(stop_at_eos, tf.equal(token, EOS_ID)))
        done = tf.logical_or(done, ended)
        next_logits, state = model(token[:, None], initial_state=state, training=False)
        return i + 1, next_logits[:, 0], state, done, out

    _, _, _, _, out = tf.while_loop(
        keep_going, step, (tf.constant(0), last, state, done, out),
        shape_invariants=(
            tf.TensorShape([]), last.shape, tf.nest.map_structure(lambda s: s.shape, state),
            done.shape, tf.TensorShape([None, None]),
        ),
    )
    return out


def ids_to_text(ids: tf.Tensor, words, eos_as_newline=False, *, tokenizer: str) -> tf.Tensor:
    """[B, N] ids → [B] strings: the tokens joined as ``tokenizer`` joins them (by spaces,
    or by nothing for ``char``; ``tfpar.data.tokenize.join_tokens``), ``<pad>`` dropped,
    and ``<eos>`` dropped or (``eos_as_newline``, a bool scalar) written as a line break.

    ``words`` maps int64 ids to strings (a ``tf.lookup`` table of id → word).
    """
    eos = tf.equal(ids, EOS_ID)
    keep = tf.logical_and(tf.not_equal(ids, PAD_ID),
                          tf.logical_or(eos_as_newline, tf.logical_not(eos)))
    kept = tf.ragged.boolean_mask(ids, keep)
    text = tf.ragged.map_flat_values(
        lambda v: tf.where(tf.equal(v, EOS_ID), "\n", words.lookup(tf.cast(v, tf.int64))), kept)
    return join_tokens(text, tokenizer)


def vocab_tables(vocab: Vocab):
    """(word → id, id → word) lookup tables of an in-memory vocabulary."""
    to_id = vocab.lookup_table()
    to_word = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.range(len(vocab), dtype=tf.int64), tf.constant(vocab.tokens, tf.string)),
        default_value=vocab.tokens[UNK_ID],
    )
    return to_id, to_word


class Sampler:
    """Python-side generation for a live model (TensorBoard samples, tests).

    Traces one ``tf.function`` for the model, so calling it every epoch costs one run,
    not one trace.
    """

    def __init__(self, model, vocab: Vocab):
        self.model = model
        self._to_id, self._to_word = vocab_tables(vocab)
        tokenizer = vocab.tokenizer

        @tf.function(autograph=False, input_signature=[
            tf.TensorSpec([None], tf.string), tf.TensorSpec([], tf.int32),
            tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.int32),
            tf.TensorSpec([], tf.int32),
        ])
        def run(prompts, max_tokens, temperature, top_k, seed):
            ids, lengths = prompt_ids(prompts, self._to_id, tokenizer=tokenizer)
            out = generate_ids(self.model, ids, lengths, max_tokens=max_tokens,
                               temperature=temperature, top_k=top_k, seed=seed)
            return ids_to_text(out, self._to_word, tokenizer=tokenizer)

        self._run = run

    def __call__(self, prompts: list[str], *, max_tokens: int = 30, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0) -> list[str]:
        """The continuation of every prompt (``""``: from a sentence start)."""
        text = self._run(tf.constant(prompts, tf.string), tf.constant(max_tokens, tf.int32),
                         tf.constant(temperature, tf.float32), tf.constant(top_k, tf.int32),
                         tf.constant(seed, tf.int32))
        return [t.decode("utf-8") for t in text.numpy()]
