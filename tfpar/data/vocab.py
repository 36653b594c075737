"""The vocabulary: built from the train split or read from a file, saved as text,
looked up in TF ops.

Ids 0, 1 and 2 are always ``<pad>``, ``<unk>`` and ``<eos>``; a built vocabulary's words
follow in order of falling train frequency, ties broken by the word itself so the same
corpus always gives the same ids. The file format is one token per line, line number =
id (line 1 holds id 0)::

    <pad>
    <unk>
    <eos>
    the
    ...

Tokens are what ``tfpar.data.tokenize.split_tokens`` makes of a line; they never hold a
line break. A file read back (a run's ``vocab.txt``, or ``--vocab-file``) is checked by
:func:`parse_tokens`; it has no train counts, so :meth:`Vocab.unigram_perplexity` is
unavailable for it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable

import numpy as np
import tensorflow as tf

from tfpar import files
from tfpar.data.text import TextSplit, line_batches, non_blank
from tfpar.data.textfile import read_text
from tfpar.data.tokenize import check_tokenizer, join_tokens, split_tokens
from tfpar.errors import DataError

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
SPECIALS = (PAD, UNK, EOS)
PAD_ID, UNK_ID, EOS_ID = 0, 1, 2
VOCAB_FILE = "vocab.txt"
# What a vocabulary file holds, for the advice of its errors.
TOKEN_PER_LINE = "one token per line (line number = id)"


@dataclasses.dataclass(frozen=True)
class Vocab:
    """An ordered token list; ``tokens[i]`` is the token with id ``i``."""

    tokens: tuple[str, ...]
    # Train-split count of every token id (specials: <eos> counts one per sentence);
    # empty for a vocabulary read from a file, which holds no counts.
    counts: tuple[int, ...] = ()
    # The tokenizer that made the tokens (tfpar.data.tokenize): the pipeline, the
    # samples and the export split text with it.
    tokenizer: str = "whitespace"

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def has_counts(self) -> bool:
        """Whether :attr:`counts` holds every token's train count (a built vocabulary)."""
        return len(self.counts) == len(self.tokens)

    @classmethod
    def build(cls, lines: Iterable[str] | TextSplit, *, tokenizer: str = "whitespace",
              max_size: int = 0, min_count: int = 1) -> "Vocab":
        """Counts the tokens of ``lines`` (a list, or a split streamed from its files) and
        keeps the most frequent (at least one); see :func:`train_counts`."""
        return cls.from_counts(train_counts(lines, tokenizer), max_size=max_size,
                               min_count=min_count)

    @classmethod
    def from_counts(cls, counts: TrainCounts, *, max_size: int = 0,
                    min_count: int = 1) -> "Vocab":
        """The vocabulary of a train pass's counts.

        Args:
          counts: from :func:`train_counts`.
          max_size: keep at most this many entries, the three specials included (0: all).
          min_count: drop words seen fewer times.

        Raises:
          DataError: no word is kept (a vocabulary holds at least one besides the
            specials, as :func:`parse_tokens` requires of a file).
        """
        counter = dict(counts.words)
        unk_in_text = counter.pop(UNK, 0)
        eos_in_text = counter.pop(EOS, 0)
        counter.pop(PAD, None)
        words = sorted(
            (w for w, c in counter.items() if c >= min_count), key=lambda w: (-counter[w], w)
        )
        if max_size:
            words = words[: max_size - len(SPECIALS)]
        if not words:
            raise DataError(
                f"the train split has no word seen at least {min_count} time(s) (min-count) "
                f"besides {', '.join(SPECIALS)}, so the vocabulary would hold no word; lower "
                "--min-count")
        kept = set(words)
        unk_count = unk_in_text + sum(c for w, c in counter.items() if w not in kept)
        ids = (0, unk_count, counts.lines + eos_in_text) + tuple(counter[w] for w in words)
        return cls(tokens=SPECIALS + tuple(words), counts=ids, tokenizer=counts.tokenizer)

    def save(self, directory: str | os.PathLike) -> str:
        """Writes ``vocab.txt`` into ``directory`` (a local folder or a URL such as
        ``gs://bucket/run``; atomically) and returns its path."""
        path = os.path.join(os.fspath(directory), VOCAB_FILE)
        files.write_text(path, "\n".join(self.tokens) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, tokenizer: str = "whitespace") -> "Vocab":
        """Reads a vocabulary file: one written by :meth:`save` (a run's ``vocab.txt``)
        or one given with ``--vocab-file``.

        The file does not name its tokenizer (the run's config.json does), so the caller
        does; nor does it hold train counts, so the result has none (``counts == ()``).

        Raises:
          DataError: the file does not exist, cannot be read, is binary or not UTF-8,
            or is not a vocabulary (see :func:`parse_tokens`).
        """
        path = Path(path) if files.is_local(path) else os.fspath(path)  # URLs stay URLs
        text = read_text(path, "vocabulary", holds=TOKEN_PER_LINE)
        return cls(tokens=parse_tokens(text, path), tokenizer=tokenizer)

    def lookup_table(self) -> tf.lookup.StaticHashTable:
        """A word -> id table; unknown words map to ``<unk>``."""
        keys = tf.constant(self.tokens[len(SPECIALS):] + (UNK, EOS), tf.string)
        ids = tf.constant(
            list(range(len(SPECIALS), len(self.tokens))) + [UNK_ID, EOS_ID], tf.int64
        )
        init = tf.lookup.KeyValueTensorInitializer(keys, ids)
        return tf.lookup.StaticHashTable(init, default_value=UNK_ID)

    def encode(self, line: str) -> list[int]:
        """The ids of one line's tokens, for tests and tools (``<eos>`` not added)."""
        ids = self.lookup_table().lookup(split_tokens([line], self.tokenizer).flat_values)
        return ids.numpy().tolist()

    def decode(self, ids: Iterable[int]) -> str:
        """Ids → text: tokens joined as :func:`tfpar.data.tokenize.join_tokens` joins
        them, ``<pad>`` dropped, ``<eos>`` written as a line break."""
        tokens = ["\n" if i == EOS_ID else self.tokens[i] for i in ids if i != PAD_ID]
        return join_tokens(tf.ragged.constant([tokens], tf.string), self.tokenizer)[0] \
            .numpy().decode("utf-8")

    def unigram_perplexity(self, lines: Iterable[str]) -> float:
        """Perplexity of ``lines`` under this vocabulary's train unigram distribution.

        The floor a model without context reaches. Every sentence predicts its words and
        one ``<eos>``; add-one smoothing keeps words unseen in train finite.

        Raises:
          DataError: the vocabulary has no train counts (it was read from a file; see
            :attr:`has_counts`).
        """
        counts = np.asarray(self.counts, np.float64)
        if not self.has_counts:
            raise DataError("unigram perplexity needs a vocabulary built from train counts")
        probs = (counts + 1.0) / (counts.sum() + len(counts))
        probs[PAD_ID] = 0.0
        table = self.lookup_table()
        total, tokens = 0.0, 0
        for batch in _line_batches(lines):
            words = split_tokens(batch, self.tokenizer)
            ids = table.lookup(words.flat_values).numpy()
            rows = int(words.nrows())
            # Every line also predicts one <eos>.
            total -= float(np.log(probs[ids]).sum()) + rows * float(np.log(probs[EOS_ID]))
            tokens += len(ids) + rows
        return float(np.exp(total / max(tokens, 1)))


def parse_tokens(text: str, path: str | os.PathLike = "") -> tuple[str, ...]:
    """The tokens of a vocabulary file's text, line ``i + 1`` holding id ``i``.

    Lines end at ``"\n"`` only (as :meth:`Vocab.save` writes them); one final line
    break is optional. Every line holds one token, none twice; the first three are
    ``<pad>``, ``<unk>``, ``<eos>``, and at least one word follows them.

    Raises:
      DataError: naming ``path``, the line and what it holds.
    """
    name = f"vocabulary file {os.fspath(path)}"
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the line break that ends the last line
    expected = ", ".join(SPECIALS)
    if not lines:
        raise DataError(f"{name} is empty; it must start with the lines {expected}, then "
                        f"{TOKEN_PER_LINE}")
    seen: dict[str, int] = {}
    for number, token in enumerate(lines, start=1):
        if "\r" in token:
            raise DataError(f"{name}: line {number} ({token!r}) holds a carriage return; "
                            "lines must end with \\n only (convert it, e.g. dos2unix)")
        if number <= len(SPECIALS) and token != SPECIALS[number - 1]:
            raise DataError(f"{name} is not a tfpar vocabulary: line {number} holds "
                            f"{token!r}, not {SPECIALS[number - 1]!r}; it must start with "
                            f"the lines {expected}")
        if not token:
            raise DataError(f"{name}: line {number} is empty; every line must hold one "
                            "token (remove the blank line)")
        if token in seen:
            raise DataError(f"{name}: token {token!r} is on line {seen[token]} and again on "
                            f"line {number}; every token must appear once")
        seen[token] = number
    if len(lines) < len(SPECIALS):
        raise DataError(f"{name} is not a tfpar vocabulary: it ends after line {len(lines)}; "
                        f"it must start with the lines {expected}")
    if len(lines) == len(SPECIALS):
        raise DataError(f"{name} holds only {expected}; it needs at least one word after "
                        "them (a vocabulary of no words maps every word to <unk>)")
    return tuple(lines)


def first_difference(a: Vocab, b: Vocab) -> str:
    """Where two vocabularies' token lists first differ, e.g. ``"line 5: 'x' against 'y'"``
    (``"no line"`` where one list has ended); ``""`` if they are the same."""
    for number in range(1, max(len(a), len(b)) + 1):
        x, y = (v.tokens[number - 1] if number <= len(v) else None for v in (a, b))
        if x != y:
            return (f"line {number}: {'no line' if x is None else repr(x)} against "
                    f"{'no line' if y is None else repr(y)}")
    return ""


# ----------------------------------------------------------------------------- the train pass
# Length histograms have this many bins; the last counts every longer line.
HISTOGRAM_BINS = 1024


@dataclasses.dataclass(frozen=True)
class TrainCounts:
    """What one pass over the train split counts."""

    # token -> count (specials included as they occur in the text).
    words: dict[str, int]
    # non-blank lines.
    lines: int
    # [HISTOGRAM_BINS] int64: lengths[n] lines predict n tokens (their tokens + <eos>);
    # the last bin counts every longer line.
    lengths: np.ndarray
    tokenizer: str


def train_counts(lines: Iterable[str] | TextSplit, tokenizer: str, *,
                 progress: bool = False) -> TrainCounts:
    """One pass over ``lines``: every token's count and the length histogram, in TF ops.

    ``lines`` is a :class:`tfpar.data.text.TextSplit` (streamed from its files, batch by
    batch; host memory holds the counts, not the text) or an iterable of strings. The
    counts are kept in a ``tf.lookup`` hash table, so Python never sees a token before the
    end. ``progress``: a progress bar over the split's bytes (on stderr).
    """
    check_tokenizer(tokenizer)
    table = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=0)
    hist = tf.Variable(tf.zeros([HISTOGRAM_BINS], tf.int64), trainable=False)
    lines_seen = tf.Variable(tf.constant(0, tf.int64), trainable=False)

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None], tf.string)])
    def add(batch):
        words = split_tokens(batch, tokenizer)
        unique, _, counts = tf.unique_with_counts(words.flat_values, out_idx=tf.int64)
        table.insert(unique, table.lookup(unique) + counts)
        lengths = tf.minimum(words.row_lengths() + 1, HISTOGRAM_BINS - 1)
        hist.assign_add(tf.math.bincount(lengths, minlength=HISTOGRAM_BINS,
                                         maxlength=HISTOGRAM_BINS, dtype=tf.int64))
        lines_seen.assign_add(tf.size(batch, tf.int64))
        return tf.reduce_sum(tf.cast(tf.strings.length(batch), tf.int64)) + tf.size(batch, tf.int64)

    bar = None
    if isinstance(lines, TextSplit):
        if progress:
            import keras

            bar = keras.utils.Progbar(lines.nbytes, unit_name="byte")
        for batch in _line_batches(lines):
            done = add(batch)
            if bar is not None:
                bar.add(int(done))
    else:
        for batch in _line_batches(lines):
            add(batch)
    keys, values = table.export()
    words = dict(zip((k.decode("utf-8") for k in keys.numpy()), values.numpy().tolist()))
    return TrainCounts(words=words, lines=int(lines_seen.numpy()),
                       lengths=hist.numpy(), tokenizer=tokenizer)


def _line_batches(lines, batch: int = 4096):
    """[k] string tensors of ``lines``' stripped, non-blank lines: a TextSplit's record
    batches, or ``batch`` strings at a time of an iterable."""
    if isinstance(lines, TextSplit):
        yield from line_batches(lines)
        return
    # Stripped and without blank lines, as a split's files are read.
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == batch:
            yield non_blank(tf.constant(chunk, tf.string))
            chunk = []
    if chunk:
        yield non_blank(tf.constant(chunk, tf.string))
