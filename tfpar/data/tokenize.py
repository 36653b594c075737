"""Tokenizers: text → tokens and tokens → text, in TF ops, the one definition of both.

Training (vocabulary counts, the input pipeline, bucket lengths, the unigram baseline)
and serving (the SavedModel's ``score`` and ``generate``, TensorBoard samples) all call
:func:`split_tokens` and :func:`join_tokens`, so a served model reads text exactly as its
training run did. The name is ``--tokenizer`` / ``DataConfig.tokenizer``:

``whitespace`` (default)
    Tokens are the runs of characters between ASCII whitespace (space, ``\\t``, ``\\n``,
    ``\\v``, ``\\f``, ``\\r``), as ``tf.strings.split`` cuts them. Other Unicode spaces
    (U+00A0, U+2003, …) are part of a token. ``"a  b\\tc"`` → ``a b c``.
``punct``
    Word runs and punctuation apart. Separators are whitespace: the ASCII set above and
    every Unicode space separator (``\\pZ``). A token is a maximal run of word characters
    ``[\\pL\\pM\\pN_]`` (Unicode letters, combining marks, digits, underscore), or any one
    other character: ``"Citizen: you, sir!"`` → ``Citizen : you , sir !``,
    ``"naïve--3.14"`` → ``naïve - - 3 . 14``.
``char``
    Every Unicode character is a token, spaces and tabs included (``"a b"`` → ``a``,
    ``" "``, ``b``); a ``\\n`` becomes the ``<eos>`` token (a line's end, as between lines
    of the corpus) and a ``\\r`` is dropped, so no token ever holds a line break.

Decoding joins a line's tokens with one space (``whitespace``, ``punct``) or with nothing
(``char``); a ``"\\n"`` token (what :mod:`tfpar.serving.sample` writes for ``<eos>``)
stands between lines without spaces around it.
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.config import TOKENIZERS, check_tokenizer

__all__ = ["TOKENIZERS", "check_tokenizer", "split_tokens", "join_tokens", "separator"]

EOS_TOKEN = "<eos>"  # The vocabulary's end-of-line token (tfpar.data.vocab.EOS).

# RE2 syntax; RE2's \s is [\t\n\f\r ], so \v is named apart.
_WORD = r"[\pL\pM\pN_]"
_SPACE = r"[\s\v\pZ]"
_PUNCT_TOKEN = rf"{_WORD}+|[^\pL\pM\pN_\s\v\pZ]"


def separator(tokenizer: str) -> str:
    """The string decoding puts between two tokens of a line: ``" "`` or ``""``."""
    check_tokenizer(tokenizer)
    return "" if tokenizer == "char" else " "


@tf.autograph.experimental.do_not_convert
def split_tokens(lines: tf.Tensor, tokenizer: str) -> tf.RaggedTensor:
    """[N] strings → [N, (n_i)] token strings, as the module docstring defines them.

    Args:
      lines: a [N] string tensor (or anything ``tf.constant`` takes), UTF-8.
      tokenizer: one of :data:`TOKENIZERS`; a Python string, fixed when traced.

    Raises:
      ConfigError: ``tokenizer`` is not one of :data:`TOKENIZERS`.
    """
    check_tokenizer(tokenizer)
    lines = tf.convert_to_tensor(lines, tf.string)
    if tokenizer == "whitespace":
        return tf.strings.split(lines)
    if tokenizer == "punct":
        spaced = tf.strings.regex_replace(lines, _PUNCT_TOKEN, r" \0 ")
        return tf.strings.split(tf.strings.regex_replace(spaced, _SPACE, " "))
    chars = tf.strings.unicode_split(tf.strings.regex_replace(lines, "\r", ""), "UTF-8")
    return tf.ragged.map_flat_values(
        lambda c: tf.where(tf.equal(c, "\n"), EOS_TOKEN, c), chars)


def join_tokens(tokens: tf.RaggedTensor, tokenizer: str) -> tf.Tensor:
    """[N, (n_i)] token strings → [N] texts: the inverse of :func:`split_tokens` up to
    the separators it dropped (``whitespace``/``punct`` write one space between tokens).

    A ``"\\n"`` token ends a line: no separator is written next to it.
    """
    sep = separator(tokenizer)
    text = tf.strings.reduce_join(tokens, axis=1, separator=sep)
    if sep:
        # Tokens of these tokenizers never hold whitespace, so every space next to a
        # "\n" is a separator.
        text = tf.strings.regex_replace(text, " ?\n ?", "\n")
    return text
