"""Loads the corpus a config names: the synthetic source or text (folder, file, named, TFDS).

The one function the loop and the scripts call; every split comes back as a
``tfpar.data.text.TextSplit`` (files on disk; the generated corpus is written to a
temporary folder first), so the input pipeline never needs to know where the text came
from.
"""

from __future__ import annotations

import dataclasses
import logging

from tfpar.config import DataConfig
from tfpar.data.text import TextSplit, write_splits

log = logging.getLogger(__name__)
SPLITS = ("train", "valid", "test")


@dataclasses.dataclass(frozen=True)
class LoadedCorpus:
    """Every split's files, and the exact oracle where the source has one."""

    name: str
    splits: dict[str, TextSplit]
    # split -> perplexity of the generating source (synthetic data only).
    oracle_ppl: dict[str, float] | None = None


def load_corpus(config: DataConfig, *, seed: int = 0) -> LoadedCorpus:
    """Reads or generates the corpus ``config.source`` names.

    Raises:
      DataError: the source is missing, unreadable or empty (from ``tfpar.data.corpora``).
    """
    if config.source == "synthetic":
        from tfpar.data import synthetic

        spec = synthetic.SyntheticSpec(
            train_sentences=config.synthetic_train, valid_sentences=config.synthetic_valid,
            test_sentences=config.synthetic_test, seed=seed,
        )
        corpus = synthetic.generate_corpus(spec)
        splits = write_splits({"train": corpus.train, "valid": corpus.valid,
                               "test": corpus.test})
        oracle = {s: corpus.oracle_perplexity(s) for s in SPLITS}
        return LoadedCorpus("synthetic", splits, oracle)
    from tfpar.data import corpora

    corpus = corpora.load_text_corpus(
        config.source, input_dir=config.input_dir, tfds_data_dir=config.tfds_data_dir,
        split_fractions=config.split_fractions,
    )
    return LoadedCorpus(corpus.name, {"train": corpus.train, "valid": corpus.valid,
                                      "test": corpus.test})
