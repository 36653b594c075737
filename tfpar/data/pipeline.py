"""The input pipeline: text lines → batches of token ids, in TF ops.

Every element, in both modes, is a dict::

    {"inputs": [B, T] int32, "targets": [B, T] int32}

``targets`` is ``inputs`` shifted one step left; id 0 (``<pad>``) in ``targets`` marks
padding. ``B`` is a per-replica (or, before sharding, global) batch and ``T`` varies from
batch to batch.

Tokens are what ``tfpar.data.tokenize.split_tokens`` makes of a line with the
vocabulary's tokenizer (words, words and punctuation, or characters).

Sentence mode (default). A line ``w1 … wn`` becomes one example; ``<eos>`` stands on both
ends so the first word is predicted from a sentence start and the end is predicted too::

    ids:      <eos> w1  w2 … wn  <eos>
    inputs:   <eos> w1  w2 … wn            (n + 1 tokens)
    targets:        w1  w2 … wn  <eos>     (n + 1 tokens)

Examples are shuffled by a seeded permutation that changes each epoch, bucketed by
length (boundaries chosen from the train length histogram), padded to the longest in the
batch and prefetched.

Stream mode (``--mode stream``). The split is one long token stream (every line followed
by ``<eos>``), cut into ``B`` contiguous columns and read ``bptt`` steps at a time, so row
``b`` of window ``k+1`` continues row ``b`` of window ``k`` and the RNN state carries over::

    stream: t0 t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13 …        (B = 2, bptt = 3)
    column 0: t0 t1 t2 t3 t4 t5 t6        window 0: inputs [[t0 t1 t2],  [t7 t8 t9]]
    column 1: t7 t8 t9 t10 t11 t12 t13              targets [[t1 t2 t3],  [t8 t9 t10]]

Sharding. Global batches are built identically in every input pipeline, then each
pipeline emits, in order, the row slices that belong to its local replicas (slice sizes
differ by at most one row). ``tf.distribute`` hands consecutive elements of one pipeline to
consecutive local replicas, so replica ``r`` of the job always sees rows
``shard_bounds(B, R)[r]`` of each global batch: the union over replicas is exactly the
global batch a single device would see, with nothing duplicated or skipped. A slice that
would hold no rows holds one row of padding instead (zero tokens, zero gradient).
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import tensorflow as tf

from tfpar.config import DataConfig
from tfpar.errors import DataError
from tfpar.data.tokenize import split_tokens
from tfpar.data.vocab import EOS_ID, PAD_ID, Vocab

log = logging.getLogger(__name__)
AUTOTUNE = tf.data.AUTOTUNE


# ----------------------------------------------------------------------------- tokenising
def tokenize(lines: tf.Tensor, table: tf.lookup.StaticHashTable, *,
             tokenizer: str) -> tf.RaggedTensor:
    """[N] strings → [N, (n_i)] int32 token ids (``tfpar.data.tokenize.split_tokens``
    with ``tokenizer``, OOV → <unk>)."""
    words = split_tokens(lines, tokenizer)
    return tf.cast(tf.ragged.map_flat_values(table.lookup, words), tf.int32)


def sentence_lengths(lines: Sequence[str], *, tokenizer: str) -> np.ndarray:
    """[N] lines → [N] int64 predicted tokens per line in sentence mode: tokens + one
    ``<eos>``."""
    lengths = [split_tokens(tf.constant(list(lines[i:i + 4096]), tf.string),
                            tokenizer).row_lengths().numpy()
               for i in range(0, len(lines), 4096)]
    return np.concatenate([np.zeros([0], np.int64), *lengths]).astype(np.int64) + 1


def stream_ids(lines: Sequence[str], vocab: Vocab) -> tf.Tensor:
    """The whole split as one [N] int32 stream: each line's ids then ``<eos>``."""
    ids = tokenize(tf.constant(list(lines)), vocab.lookup_table(), tokenizer=vocab.tokenizer)
    eos = tf.fill([ids.nrows(), 1], EOS_ID)
    return tf.concat([ids, tf.RaggedTensor.from_tensor(eos)], axis=1).flat_values


# ----------------------------------------------------------------------------- bucketing
def bucket_boundaries(lengths: np.ndarray, max_length: int, max_pad_fraction: float) -> list[int]:
    """Chooses bucket boundaries from a length histogram.

    Greedy from the shortest length: a bucket grows while padding every example in it
    to the bucket's longest length would waste at most ``max_pad_fraction`` of its
    tokens. Returns the exclusive upper bounds expected by
    ``tf.data.Dataset.bucket_by_sequence_length`` (the last bucket is open-ended).
    """
    hist = np.bincount(np.minimum(lengths, max_length), minlength=max_length + 1)
    boundaries, start = [], 1
    while start <= max_length:
        end = start
        while end + 1 <= max_length:
            counts = hist[start:end + 2]
            span = np.arange(start, end + 2)
            real = float((counts * span).sum())
            padded = float(counts.sum() * (end + 1))
            if real and (padded - real) / padded > max_pad_fraction:
                break
            end += 1
        boundaries.append(end + 1)
        start = end + 1
    return boundaries[:-1]


# ----------------------------------------------------------------------------- sharding
def shard_bounds(rows: tf.Tensor, num_shards: int, index: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Start and size of shard ``index`` of ``rows`` rows; sizes differ by at most one.

    The first ``rows % num_shards`` shards get one row more than the others.
    """
    rows = tf.cast(rows, tf.int32)
    index = tf.cast(index, tf.int32)
    base, extra = rows // num_shards, rows % num_shards
    start = index * base + tf.minimum(index, extra)
    size = base + tf.cast(index < extra, tf.int32)
    return start, size


def shard_rows(batch: dict, num_shards: int, index: int | tf.Tensor) -> dict:
    """Rows of ``batch`` that belong to shard ``index``; never empty (see module doc).

    The shard also gets "rows" [b] int32, its rows' indices in ``batch`` (kept from
    ``batch`` when it has them, so a shard of a shard still knows its global rows): they
    key the dropout masks, so a replica draws the masks one device draws for its rows.
    """
    start, size = shard_bounds(tf.shape(batch["targets"])[0], num_shards, index)
    if "rows" not in batch:
        batch = {**batch, "rows": tf.range(tf.shape(batch["targets"])[0], dtype=tf.int32)}
    # An empty shard becomes one all-padding row: Keras RNN kernels reject 0-row
    # batches, and a padding row contributes exactly zero loss and zero gradient.
    return {
        key: tf.cond(size > 0, lambda v=value: v[start:start + size], lambda v=value: _pad_row(v))
        for key, value in batch.items()
    }


def state_rows(state: tf.Tensor, start: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
    """Rows ``start:start+size`` of a [B, H] recurrent state: the state of the shard
    ``shard_bounds`` gives; one zero row when ``size`` is 0 (its padding row)."""
    return tf.cond(size > 0, lambda: state[start:start + size],
                   lambda: tf.zeros(tf.concat([[1], tf.shape(state)[1:]], 0), state.dtype))


def _pad_row(value: tf.Tensor) -> tf.Tensor:
    shape = tf.concat([[1], tf.shape(value)[1:]], axis=0)
    return tf.fill(shape, tf.constant(PAD_ID, value.dtype))


def per_replica(global_batches: tf.data.Dataset, input_context=None) -> tf.data.Dataset:
    """Turns a dataset of global batches into this pipeline's per-replica slices.

    With ``input_context`` None (one device) the global batches pass through unchanged.
    """
    if input_context is None or input_context.num_replicas_in_sync == 1:
        return global_batches
    total = input_context.num_replicas_in_sync
    local = total // input_context.num_input_pipelines
    first = input_context.input_pipeline_id * local

    def slices(batch):
        return tf.data.Dataset.range(local).map(
            lambda i: shard_rows(batch, total, tf.cast(first + i, tf.int32))
        )

    return global_batches.flat_map(slices)


# ----------------------------------------------------------------------------- datasets
class InputData:
    """Builds the datasets of every split for one corpus and vocabulary.

    The object holds only plain data (lines, boundaries, the vocabulary); each call
    builds a fresh ``tf.data`` graph, so it can be called inside a
    ``distribute_datasets_from_function`` dataset function on any worker.
    """

    def __init__(self, splits: dict[str, list[str]], vocab: Vocab, config: DataConfig, *,
                 seed: int = 0):
        self.splits = splits
        self.vocab = vocab
        self.config = config
        self.seed = seed
        for name, lines in splits.items():
            if not lines:
                raise DataError(f"the {name} split has no sentences (only blank lines or empty)")
        if vocab.tokenizer != config.tokenizer:
            raise DataError(f"the vocabulary was built with the {vocab.tokenizer!r} tokenizer "
                            f"but the data config asks for {config.tokenizer!r}; build it "
                            "with the config's tokenizer")
        train_lengths = sentence_lengths(splits["train"], tokenizer=vocab.tokenizer)
        self.boundaries = bucket_boundaries(
            train_lengths, config.max_length, config.max_pad_fraction
        )
        too_long = int((train_lengths > config.max_length).sum())
        if too_long and config.mode == "sentence":
            verb = "split into pieces" if config.long_sentences == "split" else "truncated"
            log.info("%d train sentences are longer than max-length %d tokens and are %s",
                     too_long, config.max_length, verb)
        self._streams: dict[str, tf.Tensor] = {}

    # -- sentence mode
    def _examples(self, lines: list[str]) -> tf.data.Dataset:
        table = self.vocab.lookup_table()
        max_len = self.config.max_length
        split_long = self.config.long_sentences == "split"

        tokenizer = self.vocab.tokenizer

        def encode(line_batch):
            ids = tokenize(line_batch, table, tokenizer=tokenizer)
            eos = tf.fill([ids.nrows(), 1], EOS_ID)
            eos = tf.RaggedTensor.from_tensor(eos)
            full = tf.concat([eos, ids, eos], axis=1)
            return {"inputs": full[:, :-1], "targets": full[:, 1:]}

        ds = tf.data.Dataset.from_tensor_slices(lines).batch(1024)
        ds = ds.map(encode, num_parallel_calls=AUTOTUNE).unbatch()

        def pieces(ex):
            if split_long:
                framed = {k: tf.signal.frame(v, max_len, max_len, pad_end=True, pad_value=PAD_ID)
                          for k, v in ex.items()}
                return tf.data.Dataset.from_tensor_slices(framed).map(_trim)
            return tf.data.Dataset.from_tensors({k: v[:max_len] for k, v in ex.items()})

        return ds.flat_map(pieces)

    def sentence_batches(self, split: str, batch_size: int, *, shuffle: bool, epoch: int = 0
                         ) -> tf.data.Dataset:
        """Global batches of ``split`` in sentence mode (bucketed, padded)."""
        lines = self.splits[split]
        if shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(lines))
            lines = [lines[i] for i in order]
        ds = self._examples(lines)
        ds = ds.bucket_by_sequence_length(
            lambda ex: tf.shape(ex["targets"])[0],
            bucket_boundaries=self.boundaries,
            bucket_batch_sizes=[batch_size] * (len(self.boundaries) + 1),
            padding_values={"inputs": PAD_ID, "targets": PAD_ID},
        )
        return ds

    # -- stream mode
    def stream_batches(self, split: str, batch_size: int) -> tf.data.Dataset:
        """Global batches of ``split`` in stream mode (contiguous columns, bptt windows)."""
        if split not in self._streams:
            self._streams[split] = stream_ids(self.splits[split], self.vocab)
        stream = self._streams[split]
        columns = int(stream.shape[0]) // batch_size
        if columns < 2:
            raise DataError(
                f"the {split} split has {int(stream.shape[0])} tokens, too few for "
                f"{batch_size} stream columns; use a smaller --batch-size"
            )
        data = tf.reshape(stream[: batch_size * columns], [batch_size, columns])
        bptt = self.config.bptt
        starts = tf.range(0, columns - 1, bptt)

        def window(start):
            size = tf.minimum(bptt, columns - 1 - start)
            return {"inputs": data[:, start:start + size],
                    "targets": data[:, start + 1:start + 1 + size]}

        return tf.data.Dataset.from_tensor_slices(starts).map(window)

    # -- both
    def batches(self, split: str, *, training: bool, epoch: int = 0, skip: int = 0,
                input_context=None, batch_size: int) -> tf.data.Dataset:
        """The per-replica dataset of ``split`` for one epoch.

        Args:
          split: "train", "valid" or "test".
          training: shuffle (sentence mode) with a permutation that depends on ``epoch``.
          epoch: selects the shuffle; the same epoch always gives the same batches.
          skip: global batches to skip (resuming in the middle of an epoch).
          input_context: ``tf.distribute.InputContext`` or None for one device.
          batch_size: global batch size.
        """
        if self.config.mode == "stream":
            ds = self.stream_batches(split, batch_size)
        else:
            ds = self.sentence_batches(split, batch_size, shuffle=training, epoch=epoch)
        if skip:
            ds = ds.skip(skip)
        ds = per_replica(ds, input_context)
        return ds.prefetch(AUTOTUNE)


def _trim(ex: dict) -> dict:
    """Drops the padding that ``tf.signal.frame`` added to the last piece."""
    length = tf.reduce_sum(tf.cast(tf.not_equal(ex["targets"], PAD_ID), tf.int32))
    return {k: v[:length] for k, v in ex.items()}


def count_tokens(dataset: tf.data.Dataset) -> tuple[int, int]:
    """(real target tokens, padded slots) in a dataset of batches; for tests and reports."""
    real = slots = 0
    for batch in dataset:
        t = batch["targets"].numpy()
        real += int((t != PAD_ID).sum())
        slots += t.size
    return real, slots
