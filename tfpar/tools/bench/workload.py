"""What every contender trains on: the corpus, its vocabulary and input data, the model."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tfpar.tools.bench.spec import BenchSpec


@dataclasses.dataclass
class Setup:
    spec: BenchSpec
    corpus_name: str
    splits: dict
    vocab: Any
    stream_data: Any  # InputData in stream mode
    sentence_data: Any  # InputData in sentence mode

    def vocab_ids(self, split: str):
        """[N] int32 numpy: ``split`` as one token stream (each line's ids, then
        ``<eos>``), for the plain-Keras baseline that trains from arrays in memory."""
        import numpy as np

        from tfpar.data.pipeline import stream_ids
        from tfpar.data.text import line_batches

        table, parts = self.vocab.lookup_table(), [np.zeros([0], np.int32)]
        for lines in line_batches(self.splits[split]):
            parts.append(stream_ids(lines, table, tokenizer=self.vocab.tokenizer).numpy())
        return np.concatenate(parts)


def load_setup(spec: BenchSpec, *, vocab_file: str | None = None) -> Setup:
    """Reads (or generates) the corpus and builds the vocabulary (or reads
    ``vocab_file``, used whole) and the input data.

    Raises:
      DataError: ``spec.data`` names no readable corpus (e.g. the default ``ptb`` where
        ``input/ptb/`` is missing): one line naming the download command and ``--data``.
    """
    from tfpar.config import DataConfig
    from tfpar.data.sources import load_corpus
    from tfpar.data.pipeline import InputData
    from tfpar.data.vocab import Vocab

    data_config = DataConfig(source=spec.data, mode="stream", bptt=spec.bptt,
                             synthetic_train=spec.synthetic_sentences,
                             synthetic_valid=max(1, spec.synthetic_sentences // 10),
                             synthetic_test=max(1, spec.synthetic_sentences // 10))
    corpus = load_corpus(data_config, seed=spec.seed)
    vocab = (Vocab.load(vocab_file) if vocab_file else
             Vocab.build(corpus.splits["train"], max_size=spec.vocab_size))
    stream = InputData(corpus.splits, vocab, data_config, seed=spec.seed)
    sentence = InputData(corpus.splits, vocab, dataclasses.replace(data_config, mode="sentence"),
                         seed=spec.seed)
    return Setup(spec, corpus.name, corpus.splits, vocab, stream, sentence)


def model_config(spec: BenchSpec, precision: str | None = None, *, fused: bool = True):
    """The benchmark's model (``precision`` overrides the spec's; ``fused`` False: the
    logits, then the cross-entropy, ``--no-fused-softmax``)."""
    from tfpar.config import ModelConfig

    return ModelConfig(layers=spec.layers, embed_dim=spec.embed_dim, hidden_dim=spec.hidden_dim,
                       precision=precision or spec.precision, softmax=spec.softmax,
                       num_sampled=spec.num_sampled, fused_softmax=fused, dropout=0.0,
                       tie_embeddings=False, init_scale=0.0)


def fixed_windows(stream: np.ndarray, bptt: int) -> tuple[np.ndarray, np.ndarray]:
    """A token stream cut into non-overlapping windows, the way the Keras guides feed
    ``model.fit``: inputs [N, bptt] and the next tokens as targets [N, bptt]."""
    n = (len(stream) - 1) // bptt
    x = stream[: n * bptt].reshape(n, bptt)
    y = stream[1: n * bptt + 1].reshape(n, bptt)
    return x, y
