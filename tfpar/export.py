"""SavedModel export in the versioned layout TensorFlow Serving expects.

``<export_dir>/<name>/<version>/`` with the next free integer version. The model is
written into a hidden temporary folder next to it and renamed into place, so a reader
never sees a half-written version. The export is built from a fresh copy of the model
made outside any strategy scope, so a model trained under any strategy exports the same.

Signatures:
  serving_default: ``token_ids`` [B, T] int32 → ``log_probs`` [B, T, V] float32, the
    next-token log-probabilities at every position (0 = padding).
The vocabulary travels with the model as the asset ``vocab.txt`` (line number = id).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

import tensorflow as tf

from tfpar.config import Config
from tfpar.errors import CheckpointError
from tfpar.model import build_model
from tfpar.vocab import UNK_ID, Vocab

log = logging.getLogger(__name__)


class LanguageModelModule(tf.Module):
    """What the SavedModel holds: the model, the vocabulary table and the signatures."""

    def __init__(self, model, vocab_file: str):
        super().__init__()
        self.model = model
        self.vocab_size = model.vocab_size
        self.vocab_asset = tf.saved_model.Asset(vocab_file)
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.TextFileInitializer(
                self.vocab_asset, tf.string, tf.lookup.TextFileIndex.WHOLE_LINE,
                tf.int64, tf.lookup.TextFileIndex.LINE_NUMBER,
            ),
            default_value=UNK_ID,
        )

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="token_ids")])
    def serving_default(self, token_ids):
        """[B, T] token ids → {"log_probs": [B, T, V]}."""
        checks = [
            tf.debugging.assert_non_negative(
                token_ids, message="token_ids must be >= 0 (0 is padding)"),
            tf.debugging.assert_less(
                token_ids, tf.constant(self.vocab_size, tf.int32),
                message=f"token_ids must be < the vocabulary size {self.vocab_size}"),
        ]
        with tf.control_dependencies(checks):
            logits, _ = self.model(token_ids)
        return {"log_probs": tf.nn.log_softmax(logits)}

    def signatures(self) -> dict:
        return {"serving_default": self.serving_default}


def next_version(base: str) -> int:
    """1 + the largest integer folder name in ``base`` (1 when there is none)."""
    if not os.path.isdir(base):
        return 1
    versions = [int(n) for n in os.listdir(base) if re.fullmatch(r"\d+", n)]
    return max(versions, default=0) + 1


def fresh_copy(model, config: Config):
    """The same architecture and weights, built outside any strategy scope."""
    copy = build_model(config.model, model.vocab_size, seed=config.train.seed)
    copy.set_weights(model.get_weights())
    return copy


def export_model(model, vocab: Vocab, config: Config) -> str:
    """Writes the next version of the SavedModel and returns its path.

    Raises:
      CheckpointError: the export dir cannot be written (the message names it); nothing
        half-written is left behind.
    """
    base = os.path.join(config.run.export_dir, config.run.export_name)
    try:
        os.makedirs(base, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=base)
    except OSError as e:
        raise CheckpointError(
            f"cannot write to --export-dir {config.run.export_dir!r}: {e.strerror}; give a "
            "writable folder or --no-export") from None
    try:
        vocab.save(staging)
        module = LanguageModelModule(fresh_copy(model, config),
                                     os.path.join(staging, "vocab.txt"))
        out = os.path.join(staging, "model")
        tf.saved_model.save(module, out, signatures=module.signatures())
        version = next_version(base)
        final = os.path.join(base, str(version))
        os.rename(out, final)
    except OSError as e:
        raise CheckpointError(
            f"export to {base!r} failed: {e.strerror or e}; nothing was written") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported SavedModel version %d to %s", version, final)
    return final
