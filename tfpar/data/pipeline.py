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

Examples are shuffled (seeded, changing each epoch), bucketed by length (boundaries
chosen from the train length histogram), padded to the longest in the batch and
prefetched; the buckets' partial last batches are mixed into full batches of all lengths
(:func:`fill_partial_batches`), so only an epoch's last batch may hold fewer rows.

Stream mode (``--mode stream``). The split is one long token stream (every line followed
by ``<eos>``), cut into ``B`` contiguous columns of equal length (the last ``N mod B``
tokens left out) and read ``bptt`` steps at a time, so row ``b`` of window ``k+1``
continues row ``b`` of window ``k`` and the RNN state carries over::

    stream: t0 t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13 …        (B = 2, bptt = 3)
    column 0: t0 t1 t2 t3 t4 t5 t6        window 0: inputs [[t0 t1 t2],  [t7 t8 t9]]
    column 1: t7 t8 t9 t10 t11 t12 t13              targets [[t1 t2 t3],  [t8 t9 t10]]

Input pipelines. ``InputData.batches`` makes one input pipeline's batches: the global
batches, or (sentence mode, ``pipelines`` > 1) batches of this pipeline's rows of each
global batch from its own disjoint share of the lines (its own files, or every P-th line
of fewer files: :func:`shares_files`). Cutting batches into replica shares is the
parallel layer's (``tfpar.parallel.rows``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Sequence

import numpy as np
import tensorflow as tf

from tfpar.config import DataConfig
from tfpar.errors import DataError
from tfpar.data.text import (Segment, TextSplit, cut, iterate_lines, line_batches, segment_lines,
                             segment_table, write_splits)
from tfpar.data.tokenize import split_tokens
from tfpar.data.vocab import EOS_ID, PAD_ID, Vocab, train_counts

log = logging.getLogger(__name__)
AUTOTUNE = tf.data.AUTOTUNE
# tf.data hands every function it traces to autograph unless it is marked; the pipeline's
# functions are plain graph code (named ones carry the decorator, lambdas are wrapped).
plain = tf.autograph.experimental.do_not_convert


# ----------------------------------------------------------------------------- tokenising
@plain
def tokenize(lines: tf.Tensor, table: tf.lookup.StaticHashTable, *,
             tokenizer: str) -> tf.RaggedTensor:
    """[N] strings → [N, (n_i)] int32 token ids (``tfpar.data.tokenize.split_tokens``
    with ``tokenizer``, OOV → <unk>)."""
    words = split_tokens(lines, tokenizer)
    return tf.cast(tf.ragged.map_flat_values(table.lookup, words), tf.int32)


@plain
def with_eos(ids: tf.RaggedTensor, *, before: bool = False) -> tf.RaggedTensor:
    """[N, (n_i)] ids → each row followed (and, ``before``, also preceded) by ``<eos>``."""
    eos = tf.RaggedTensor.from_tensor(tf.fill([ids.nrows(), 1], EOS_ID))
    return tf.concat([eos, ids, eos] if before else [ids, eos], axis=1)


@plain
def split_rows(ids: tf.RaggedTensor, length: int) -> tf.RaggedTensor:
    """[N, (n_i)] → [M, (m_j)]: each row cut into consecutive pieces of ``length`` ids
    (the last piece of a row holds the rest), pieces in row order. Rows are never empty
    here (an example has at least its ``<eos>``)."""
    n = ids.row_lengths()  # [N], in the row partition's dtype, which the pieces keep
    pieces = (n + length - 1) // length  # [N]
    row = tf.repeat(tf.range(tf.size(n, n.dtype)), pieces)  # [M] the row of each piece
    index = tf.range(tf.size(row, n.dtype)) - tf.gather(tf.cumsum(pieces, exclusive=True), row)
    sizes = tf.minimum(tf.cast(length, n.dtype), tf.gather(n, row) - index * length)
    return tf.RaggedTensor.from_row_lengths(ids.flat_values, sizes)


@plain
def stream_ids(lines: tf.Tensor, table: tf.lookup.StaticHashTable, *,
               tokenizer: str) -> tf.Tensor:
    """[N] lines → [M] int32: a stream-mode token stream, each line's ids then ``<eos>``."""
    return with_eos(tokenize(lines, table, tokenizer=tokenizer)).flat_values


# ----------------------------------------------------------------------------- bucketing
def bucket_boundaries(lengths: np.ndarray, max_length: int, max_pad_fraction: float) -> list[int]:
    """Chooses bucket boundaries from a length histogram.

    ``lengths`` [L]: ``lengths[n]`` sentences have ``n`` predicted tokens (the vocabulary
    pass's ``TrainCounts.lengths``); longer than ``max_length`` counts as ``max_length``.

    Greedy from the shortest length: a bucket grows while padding every example in it
    to the bucket's longest length would waste at most ``max_pad_fraction`` of its
    tokens. Returns the exclusive upper bounds expected by
    ``tf.data.Dataset.bucket_by_sequence_length`` (the last bucket is open-ended).
    """
    lengths = np.asarray(lengths, np.int64)
    hist = np.zeros([max_length + 1], np.int64)
    upto = min(len(lengths), max_length)
    hist[:upto] = lengths[:upto]
    hist[max_length] += lengths[max_length:].sum()  # longer ones are cut to max_length
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


def fill_partial_batches(batches: tf.data.Dataset, batch_size: int,
                         seed: int | None = None) -> tf.data.Dataset:
    """Bucketed batches with the buckets' partial batches mixed into full ones.

    ``bucket_by_sequence_length`` ends an epoch by flushing every bucket's partial batch:
    dozens of steps of a few rows each, at the end of every epoch. Each would be a
    full-size (clipped) update from a handful of sentences, right before evaluation (on
    the quick start's 43 of 1,020 steps they cost 8% of valid perplexity). Joined in the
    order they are flushed, they would instead end the epoch with a run of batches of
    ever longer sentences (the quick start's last 24 steps: mean lengths 2.4, 4.7, …,
    78.7), and lr-20 SGD's last updates teach the model that sentences do not end: the
    expected number of ``<eos>`` per sentence fell to 0.18 and generated sentences ran
    2.5 times the corpus's length.

    So the partial batches' rows wait until the epoch's full batches are through, are
    shuffled together (``seed``; kept in order when ``None``) and leave as batches of
    ``batch_size`` rows of mixed lengths, padded to their longest; only the epoch's last
    batch may be smaller.

    Elements: {"inputs": [b, T], "targets": [b, T]} in and out.
    """
    marker = {"inputs": tf.zeros([0, 1], tf.int32), "targets": tf.zeros([0, 1], tf.int32)}
    tagged = batches.map(plain(lambda b: (b, False))).concatenate(
        tf.data.Dataset.from_tensors((marker, True)))
    size = tf.constant(batch_size, tf.int32)
    shuffle = tf.constant(seed is not None)
    key = tf.constant([seed or 0, 0], tf.int64)  # stateless_shuffle's [2] seed
    step = plain(lambda held, element: _fill_step(held, element, size, shuffle, key))
    start = {k: tf.zeros([0, 1], tf.int32) for k in ("inputs", "targets")}
    rows = tagged.scan(start, step).filter(plain(lambda b, ready: ready))
    return rows.flat_map(plain(lambda b, ready: tf.data.Dataset.from_tensor_slices(b).batch(
        batch_size))).map(plain(lambda b: {k: _trim_columns(v) for k, v in b.items()}))


_ROWS = tf.TensorSpec([None, None], tf.int32)
_BATCH = {"inputs": _ROWS, "targets": _ROWS}


@tf.function(autograph=False, input_signature=[
    _BATCH, (_BATCH, tf.TensorSpec([], tf.bool)), tf.TensorSpec([], tf.int32),
    tf.TensorSpec([], tf.bool), tf.TensorSpec([2], tf.int64)])
def _fill_step(held, element, batch_size, shuffle, seed):
    """:func:`fill_partial_batches`' scan step: a full batch passes through; a partial one
    joins the held rows, which leave (mixed by ``seed`` when ``shuffle``) at the end.
    Traced once per process, whatever the pipeline (every argument a tensor)."""
    batch, end = element
    rows = tf.shape(batch["targets"])[0]
    full = tf.logical_and(rows == batch_size, tf.logical_not(end))

    def join(a, b):
        length = tf.maximum(tf.shape(a)[1], tf.shape(b)[1])
        pad = lambda x: tf.pad(x, [[0, 0], [0, length - tf.shape(x)[1]]],  # noqa: E731
                               constant_values=PAD_ID)
        return tf.concat([pad(a), pad(b)], axis=0)

    def pass_through():
        return held, (batch, True)

    def hold():
        joined = {k: join(held[k], batch[k]) for k in held}
        n = tf.shape(joined["targets"])[0]
        order = tf.cond(shuffle, lambda: tf.random.experimental.stateless_shuffle(
            tf.range(n), seed=seed), lambda: tf.range(n))
        mixed = {k: tf.gather(v, order) for k, v in joined.items()}
        ready = tf.logical_and(end, n > 0)
        return joined, (mixed, ready)

    return tf.cond(full, pass_through, hold)


@plain
def _trim_columns(x: tf.Tensor) -> tf.Tensor:
    """[b, T] ids without the trailing columns that are padding in every row."""
    length = tf.reduce_max(tf.reduce_sum(tf.cast(x != PAD_ID, tf.int32), axis=1))
    return x[:, :tf.maximum(length, 1)]


# ----------------------------------------------------------------------------- datasets
@dataclasses.dataclass(frozen=True)
class StreamColumns:
    """Stream mode: the ``B`` equal columns of a split's token stream.

    Column ``r`` is tokens ``[r * length, (r + 1) * length)`` of the stream; it reads the
    (column, segment) pairs of ``segments`` tagged ``r`` in order, skipping ``skips[r]``
    tokens first."""

    tokens: int  # N, the split's stream tokens
    length: int  # C = N // B, tokens per column
    skips: tuple[int, ...]  # [B] tokens to skip in the column's first segment read
    segments: tuple[tuple[int, Segment], ...]  # (column, segment) in reading order

    @classmethod
    def plan(cls, pieces: Sequence[TextSplit], counts: Sequence[int], columns: int
             ) -> "StreamColumns":
        """Columns from line-aligned byte ``pieces`` of the split with ``counts`` stream
        tokens each: column ``r`` reads the pieces that hold its tokens."""
        starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        total = int(starts[-1])
        length = total // columns
        skips, segments = [], []
        for r in range(columns):
            first, last = r * length, (r + 1) * length  # tokens [first, last)
            # Pieces overlapping [first, last): start <= token < end, non-empty.
            lo = int(np.searchsorted(starts, first, side="right")) - 1
            hi = max(int(np.searchsorted(starts, last, side="left")), lo + 1)
            lo = min(lo, len(pieces) - 1)
            skips.append(first - int(starts[lo]))
            segments += [(r, seg) for piece in pieces[lo:hi] for seg in piece.segments]
        return cls(total, length, tuple(skips), tuple(segments))


class InputData:
    """Builds the datasets of every split of one corpus, streamed from its files.

    The object holds only plain data (each split's file segments, the bucket boundaries,
    the vocabulary); each call builds a fresh ``tf.data`` graph, so it can be called inside
    a ``distribute_datasets_from_function`` dataset function on any worker. Nothing holds a
    split in memory: host memory does not grow with the corpus.

    Args:
      splits: split name -> :class:`tfpar.data.text.TextSplit` (or a list of lines, which
        is written to a temporary file first: the synthetic corpus and tests).
      vocab: the vocabulary; its tokenizer must be ``config.tokenizer``.
      config: the data config (mode, bptt, max_length, shuffle_buffer, ...).
      seed: picks each epoch's file order and shuffle.
      lengths: [L] int64 histogram of train sentence lengths (predicted tokens per line;
        the last bin counts every longer line), from the vocabulary pass. None: taken from
        the first ``SAMPLE_LINES`` lines of train (a ``--vocab-file`` run has no pass).
    """

    def __init__(self, splits: dict, vocab: Vocab, config: DataConfig, *, seed: int = 0,
                 lengths: np.ndarray | None = None):
        if any(not isinstance(v, TextSplit) for v in splits.values()):
            lists = {k: v for k, v in splits.items() if not isinstance(v, TextSplit)}
            splits = {**splits, **write_splits(lists)}
        self.splits: dict[str, TextSplit] = splits
        self.vocab = vocab
        self.config = config
        self.seed = seed
        self._columns: dict[tuple[str, int], StreamColumns] = {}  # stream_columns' plans
        for name, split in splits.items():
            if not split.nbytes:
                raise DataError(f"the {name} split has no sentences (only blank lines or empty)")
        if vocab.tokenizer != config.tokenizer:
            raise DataError(f"the vocabulary was built with the {vocab.tokenizer!r} tokenizer "
                            f"but the data config asks for {config.tokenizer!r}; build it "
                            "with the config's tokenizer")
        if lengths is None:
            sample = itertools.islice(iterate_lines(splits["train"]), SAMPLE_LINES)
            lengths = train_counts(sample, vocab.tokenizer).lengths
            self.lengths_from = f"the first {SAMPLE_LINES:,} train lines"
        else:
            self.lengths_from = "the vocabulary pass"
        if lengths[1:].sum() == 0:
            raise DataError("the train split has no sentences (only blank lines or empty)")
        self.boundaries = bucket_boundaries(lengths, config.max_length, config.max_pad_fraction)
        too_long = int(lengths[config.max_length + 1:].sum())
        if too_long and config.mode == "sentence":
            verb = "split into pieces" if config.long_sentences == "split" else "truncated"
            log.info("%d train sentences (in %s) are longer than max-length %d tokens and "
                     "are %s", too_long, self.lengths_from, config.max_length, verb)

    def first_line(self, split: str) -> str:
        """The first non-blank line of ``split`` (for text samples)."""
        return next(iterate_lines(self.splits[split]))

    # -- sentence mode
    def _examples(self, lines: tf.data.Dataset) -> tf.data.Dataset:
        """[k] line batches → examples {"inputs": [n], "targets": [n]}, one per line
        (or per max_length piece of a long line), in line order."""
        table = self.vocab.lookup_table()
        max_len = self.config.max_length
        split_long = self.config.long_sentences == "split"
        tokenizer = self.vocab.tokenizer

        @plain
        def encode(line_batch):
            full = with_eos(tokenize(line_batch, table, tokenizer=tokenizer), before=True)
            ex = {"inputs": full[:, :-1], "targets": full[:, 1:]}
            if split_long:
                return {k: split_rows(v, max_len) for k, v in ex.items()}
            return {k: v[:, :max_len] for k, v in ex.items()}

        # Cut per batch of lines, in ragged ops: no dataset per example. Unbatched, a
        # ragged row's spec is a rank-0 RaggedTensorSpec; the identity map makes it the
        # TensorSpec that bucketing's padded batches take (the values are tensors alike).
        return lines.map(encode, num_parallel_calls=AUTOTUNE).unbatch().map(
            plain(lambda ex: ex))

    def pipeline_lines(self, split: str, *, shuffle: bool, epoch: int, pipelines: int = 1,
                       index: int = 0) -> tf.data.Dataset:
        """[k] line batches of ``split`` that input pipeline ``index`` of ``pipelines``
        reads (see :func:`shares_files`); shuffled by (seed, epoch) when ``shuffle``."""
        segments = self.splits[split].segments
        if shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(segments))
            segments = tuple(segments[i] for i in order)
        own_files = pipelines > 1 and shares_files(len(segments), pipelines)
        line_shard = pipelines > 1 and not own_files
        ds = line_batches(TextSplit(segments), interleave=shuffle,
                          share=(pipelines, index) if own_files else None)
        if line_shard or shuffle:
            ds = ds.unbatch()
            if line_shard:
                ds = ds.shard(pipelines, index)
            if shuffle:
                ds = ds.shuffle(self.config.shuffle_buffer, seed=_seed(self.seed, epoch),
                                reshuffle_each_iteration=False)
            ds = ds.batch(1024)
        return ds

    def sentence_batches(self, split: str, batch_size: int, *, shuffle: bool, epoch: int = 0,
                         pipelines: int = 1, index: int = 0) -> tf.data.Dataset:
        """Batches of ``batch_size`` rows of ``split`` in sentence mode (bucketed, padded),
        from the lines pipeline ``index`` of ``pipelines`` reads."""
        ds = self._examples(self.pipeline_lines(split, shuffle=shuffle, epoch=epoch,
                                                pipelines=pipelines, index=index))
        return fill_partial_batches(ds.bucket_by_sequence_length(
            plain(lambda ex: tf.shape(ex["targets"])[0]),
            bucket_boundaries=self.boundaries,
            bucket_batch_sizes=[batch_size] * (len(self.boundaries) + 1),
            padding_values={"inputs": PAD_ID, "targets": PAD_ID},
        ), batch_size, seed=_seed(self.seed, epoch) if shuffle else None)

    # -- stream mode
    def stream_columns(self, split: str, batch_size: int) -> StreamColumns:
        """Where each of the ``batch_size`` stream columns of ``split`` starts and ends.

        The split's token stream (N tokens: every line's ids, then ``<eos>``) is cut into
        ``batch_size`` columns of ``C = N // batch_size`` tokens; the last ``N mod
        batch_size`` tokens are left out (``batchify`` in the classic LM tutorials).
        Equal columns matter: columns that end at different windows leave the last steps
        of an epoch to the few longest ones, full-size updates on a handful of rows
        (on PTB they cost a quarter of the epoch's valid perplexity).

        Counted in one streaming pass (the tokens of line-aligned byte pieces, one per
        column, see ``tfpar.data.text.cut``), then kept: a column reads the pieces that
        hold its tokens, skipping those before its first.

        Raises:
          DataError: the split has fewer than two tokens per column.
        """
        key = (split, batch_size)
        if key not in self._columns:
            pieces = cut(self.splits[split], batch_size)
            counts = self._token_counts([seg for piece in pieces for seg in piece.segments])
            per_piece, k = [], 0
            for piece in pieces:
                per_piece.append(sum(counts[k:k + len(piece.segments)]))
                k += len(piece.segments)
            self._columns[key] = StreamColumns.plan(pieces, per_piece, batch_size)
        columns = self._columns[key]
        if columns.length < 2:
            raise DataError(
                f"the {split} split has {columns.tokens} tokens, too few for {batch_size} "
                f"stream columns of at least 2 tokens; use a batch size of at most "
                f"{max(columns.tokens // 2, 1)} (--batch-size, or --eval-batch-size for "
                "valid and test)")
        return columns

    def _token_counts(self, segments: Sequence) -> list[int]:
        """Stream tokens (each line's tokens + ``<eos>``) of every segment, in one pass.

        One dataset reads every segment's line batches, tagged with the segment's index,
        and one ``reduce`` adds each batch's count to its segment's total. (A ``reduce``
        per segment, inside a ``map``, started a dataset per segment: 0.1 s each, 1.6 s
        for the 16 columns of a 40-line split.)"""
        if not segments:
            return []
        tokenizer = self.vocab.tokenizer

        @plain
        def counted(index, segment):
            return segment_lines(*segment).map(plain(lambda b: (
                index, tf.reduce_sum(split_tokens(b, tokenizer).row_lengths())
                + tf.size(b, tf.int64))))

        @plain
        def add(totals, element):
            index, tokens = element
            return tf.tensor_scatter_nd_add(totals, [[index]], [tokens])

        totals = segment_table(segments).enumerate().flat_map(counted).reduce(
            tf.zeros([len(segments)], tf.int64), add)
        return [int(n) for n in totals.numpy()]

    def stream_batches(self, split: str, batch_size: int) -> tf.data.Dataset:
        """Global batches of ``split`` in stream mode: ``batch_size`` equal columns of the
        split's token stream (:meth:`stream_columns`), read ``bptt`` steps at a time (see
        the module docstring). One column function, traced once, reads every column; the
        columns are read in turn, a window each."""
        columns = self.stream_columns(split, batch_size)
        owner = tf.constant([r for r, _ in columns.segments], tf.int64)
        table = segment_table([seg for _, seg in columns.segments])
        skips = tf.constant(columns.skips, tf.int64)

        @plain
        def column_windows(r):
            mine = tf.data.Dataset.zip((tf.data.Dataset.from_tensor_slices(owner), table)) \
                .filter(plain(lambda who, _: tf.equal(who, r))).map(plain(lambda _, seg: seg))
            return self._windows(mine.flat_map(segment_lines), skip=tf.gather(skips, r),
                                 take=tf.constant(columns.length, tf.int64))

        ds = tf.data.Dataset.range(batch_size).interleave(
            column_windows, cycle_length=batch_size, block_length=1)
        ds = ds.batch(batch_size, drop_remainder=True)

        @plain
        def window(w):  # w: [B, bptt + 1]; the last window may be shorter (padding)
            length = tf.reduce_max(tf.reduce_sum(tf.cast(w != PAD_ID, tf.int32), axis=1))
            return {"inputs": w[:, :length - 1], "targets": w[:, 1:length]}

        return ds.map(window)

    def _windows(self, lines: tf.data.Dataset, *, skip: tf.Tensor,
                 take: tf.Tensor) -> tf.data.Dataset:
        """One column's [k] line batches → tokens ``skip`` to ``skip + take`` of their
        stream (each line's ids then ``<eos>``) as [bptt + 1] windows overlapping by one
        token; the last is padded with ``<pad>``."""
        bptt = self.config.bptt
        table = self.vocab.lookup_table()
        tokenizer = self.vocab.tokenizer

        @plain
        def trim(left, tokens):  # left: (tokens to skip, tokens to take) before this chunk
            to_skip, to_take = left
            dropped = tf.minimum(to_skip, tf.size(tokens, tf.int64))
            kept = tokens[dropped:][:to_take]
            return ((to_skip - dropped, to_take - tf.size(kept, tf.int64)),
                    (kept, to_take > 0))

        chunks = lines.map(plain(lambda b: stream_ids(b, table, tokenizer=tokenizer))) \
            .scan((skip, take), trim).take_while(plain(lambda kept, wanted: wanted)) \
            .map(plain(lambda kept, wanted: (kept, False)))
        chunks = chunks.concatenate(tf.data.Dataset.from_tensors((tf.zeros([0], tf.int32), True)))
        columns = tf.range(bptt + 1)

        @plain
        def step(carry, chunk):
            tokens, end = chunk
            buf = tf.concat([carry, tokens], 0)
            n = tf.size(buf)
            k = tf.maximum(n - 1, 0) // bptt
            full = tf.gather(buf, tf.range(k)[:, None] * bptt + columns[None, :])
            rest = buf[k * bptt:]

            def last():  # the column ends: its rest, padded, is the last window
                tail = tf.pad(rest, [[0, bptt + 1 - tf.size(rest)]], constant_values=PAD_ID)
                keep = tf.cast(tf.size(rest) >= 2, tf.int32)
                return tf.zeros([0], tf.int32), tf.concat([full, tail[None, :][:keep]], 0)

            return tf.cond(end, last, lambda: (rest, full))

        return chunks.scan(tf.zeros([0], tf.int32), step).unbatch()

    @property
    def reads_own_lines(self) -> bool:
        """Whether several input pipelines each read their own share of the lines
        (sentence mode) rather than every row (stream mode: only a reader of all rows
        knows when the epoch ends)."""
        return self.config.mode == "sentence"

    # -- both
    def batches(self, split: str, *, training: bool, epoch: int = 0, skip: int = 0,
                batch_size: int, pipelines: int = 1, index: int | tf.Tensor = 0
                ) -> tf.data.Dataset:
        """The batches of ``split`` for one epoch that input pipeline ``index`` of
        ``pipelines`` makes: ``batch_size`` rows each (stream mode: the global batches,
        whatever the pipeline).

        Args:
          split: "train", "valid" or "test".
          training: shuffle (sentence mode) by file order and a buffer that depend on
            ``epoch``.
          epoch: selects the shuffle; the same epoch always gives the same batches.
          skip: batches to skip (resuming in the middle of an epoch).
          batch_size: rows per batch.
          pipelines, index: sentence mode, the pipeline's own share of the lines
            (:func:`shares_files`); ``index`` may be a tensor (a parameter-server worker
            knows its own index only as one).
        """
        if self.config.mode == "stream":
            ds = self.stream_batches(split, batch_size)
        else:
            ds = self.sentence_batches(split, batch_size, shuffle=training, epoch=epoch,
                                       pipelines=pipelines, index=index)
        if skip:
            ds = ds.skip(skip)
        return ds.prefetch(AUTOTUNE)

    def share_summary(self, split: str, pipelines: int) -> str:
        """How ``pipelines`` input pipelines (workers) share ``split``, for the log."""
        if self.config.mode == "stream":
            return (f"stream mode: each of the {pipelines} workers reads all of {split} "
                    f"({self.splits[split].describe()}) and keeps its own share")
        files = len(self.splits[split].segments)
        if shares_files(files, pipelines):
            low, high = files // pipelines, -(-files // pipelines)
            each = f"{low}" if low == high else f"{low}-{high}"
            return (f"each of the {pipelines} workers reads its own {each} of the {files} "
                    f"{split} files (dealt anew each epoch)")
        return (f"the {split} split has {files} file(s), fewer than the {pipelines} workers: "
                f"each reads them all and keeps one line in {pipelines}")


def shares_files(segments: int, pipelines: int) -> bool:
    """How ``pipelines`` input pipelines share a split of ``segments`` segments (files):
    True, each reads its own, segments ``index, index + pipelines, ...`` of the epoch's
    file order; False (fewer files than pipelines), each reads them all and keeps lines
    ``index, index + pipelines, ...``. Either way their lines are disjoint and together
    are the split."""
    return segments >= pipelines


def _seed(seed: int, epoch: int) -> int:
    """A shuffle seed for (run seed, epoch), the same in every process."""
    return int(np.random.default_rng([seed, epoch, 1]).integers(2**31 - 1))


# Without a vocabulary pass, bucket boundaries come from this many first train lines.
SAMPLE_LINES = 100_000


def count_tokens(dataset: tf.data.Dataset) -> tuple[int, int]:
    """(real target tokens, padded slots) in a dataset of batches; for tests and reports."""
    real = slots = 0
    for batch in dataset:
        t = batch["targets"].numpy()
        real += int((t != PAD_ID).sum())
        slots += t.size
    return real, slots
