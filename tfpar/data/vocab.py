"""The vocabulary: built from the train split, saved as text, looked up in TF ops.

Ids 0, 1 and 2 are always ``<pad>``, ``<unk>`` and ``<eos>``; words follow in order of
falling train frequency, ties broken by the word itself so the same corpus always gives
the same ids. The file format is one token per line, line number = id.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Iterable

import numpy as np
import tensorflow as tf

from tfpar.errors import DataError

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
SPECIALS = (PAD, UNK, EOS)
PAD_ID, UNK_ID, EOS_ID = 0, 1, 2
VOCAB_FILE = "vocab.txt"


@dataclasses.dataclass(frozen=True)
class Vocab:
    """An ordered token list; ``tokens[i]`` is the token with id ``i``."""

    tokens: tuple[str, ...]
    # Train-split count of every token id (specials: <eos> counts one per sentence).
    counts: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def build(cls, lines: Iterable[str], *, max_size: int = 0, min_count: int = 1) -> "Vocab":
        """Counts whitespace tokens of ``lines`` and keeps the most frequent.

        Args:
          lines: train sentences.
          max_size: keep at most this many entries, the three specials included (0: all).
          min_count: drop words seen fewer times.
        """
        counter: collections.Counter[str] = collections.Counter()
        num_lines = 0
        for line in lines:
            counter.update(line.split())
            num_lines += 1
        unk_in_text = counter.pop(UNK, 0)
        eos_in_text = counter.pop(EOS, 0)
        counter.pop(PAD, None)
        words = sorted(
            (w for w, c in counter.items() if c >= min_count), key=lambda w: (-counter[w], w)
        )
        if max_size:
            words = words[: max_size - len(SPECIALS)]
        kept = set(words)
        unk_count = unk_in_text + sum(c for w, c in counter.items() if w not in kept)
        counts = (0, unk_count, num_lines + eos_in_text) + tuple(counter[w] for w in words)
        return cls(tokens=SPECIALS + tuple(words), counts=counts)

    def save(self, directory: str | os.PathLike) -> str:
        """Writes ``vocab.txt`` into ``directory`` (atomically) and returns its path."""
        path = os.path.join(os.fspath(directory), VOCAB_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(self.tokens) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Vocab":
        """Reads a file written by :meth:`save`."""
        with open(path, encoding="utf-8") as f:
            tokens = tuple(line.rstrip("\n") for line in f)
        if tokens[: len(SPECIALS)] != SPECIALS:
            raise DataError(f"{os.fspath(path)} is not a tfpar vocabulary: it must start with "
                            f"{', '.join(SPECIALS)}")
        return cls(tokens=tokens)

    def lookup_table(self) -> tf.lookup.StaticHashTable:
        """A word -> id table; unknown words map to ``<unk>``."""
        keys = tf.constant(self.tokens[len(SPECIALS):] + (UNK, EOS), tf.string)
        ids = tf.constant(
            list(range(len(SPECIALS), len(self.tokens))) + [UNK_ID, EOS_ID], tf.int64
        )
        init = tf.lookup.KeyValueTensorInitializer(keys, ids)
        return tf.lookup.StaticHashTable(init, default_value=UNK_ID)

    def encode(self, line: str) -> list[int]:
        """Python-side lookup for tests and tools (training uses :meth:`lookup_table`)."""
        index = {t: i for i, t in enumerate(self.tokens)}
        return [index.get(w, UNK_ID) for w in line.split()]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.tokens[i] for i in ids if i != PAD_ID)

    def unigram_perplexity(self, lines: Iterable[str]) -> float:
        """Perplexity of ``lines`` under this vocabulary's train unigram distribution.

        The floor a model without context reaches. Every sentence predicts its words and
        one ``<eos>``; add-one smoothing keeps words unseen in train finite.
        """
        counts = np.asarray(self.counts, np.float64)
        if counts.size != len(self.tokens):
            raise DataError("unigram perplexity needs a vocabulary built from train counts")
        probs = (counts + 1.0) / (counts.sum() + len(counts))
        probs[PAD_ID] = 0.0
        index = {t: i for i, t in enumerate(self.tokens)}
        total, tokens = 0.0, 0
        for line in lines:
            ids = [index.get(w, UNK_ID) for w in line.split()] + [EOS_ID]
            total -= float(np.log(probs[ids]).sum())
            tokens += len(ids)
        return float(np.exp(total / max(tokens, 1)))
