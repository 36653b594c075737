"""Rows: a global batch and its carried state cut into replica shares, and joined back.

Every plug-in splits the same way, so replica ``r`` of ``R`` always holds the same rows
of a global batch of ``B`` rows, whichever plug-in runs it::

    shard_bounds(B, R, r) = (start, size)      sizes differ by at most one row;
                                               the first B mod R shares get one more

    global batch [B, T]   rows 0 .. B-1
      share 0             rows 0 .. s0-1            (and state rows 0 .. s0-1)
      share 1             rows s0 .. s0+s1-1
      ...

A share keeps "rows" [b] int32, its rows' indices in the global batch: they key the
dropout masks, so a replica draws the masks one device draws for its rows. A share that
would hold no rows holds one row of padding instead (Keras RNN kernels reject 0-row
batches; a padding row adds exactly zero loss and zero gradient), and is dropped again
when the replicas' final states are joined (:func:`join`).

Who cuts:

* ``parallel_do`` and ``tower`` cut the global batch inside the step (:func:`split`), the
  pipeline cuts it into micro-batches the same way;
* ``tf.distribute`` hands consecutive elements of one input pipeline to consecutive local
  replicas, so an input pipeline emits its replicas' shares in order
  (:func:`replica_batches`). One pipeline builds the global batches and emits every
  share; several pipelines (multi_worker, one per worker) each emit their own replicas'
  shares, in sentence mode batching only their replicas' rows of each global batch from
  their own lines (:func:`pipeline_rows`), in stream mode reading every row (only a
  reader of all rows knows when the epoch ends). The union over replicas is exactly the
  global batch one device sees, nothing duplicated or skipped.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfpar.data.vocab import PAD_ID


def shard_bounds(rows: tf.Tensor, num_shards: int, index: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Start and size of share ``index`` of ``rows`` rows; sizes differ by at most one.

    The first ``rows % num_shards`` shares get one row more than the others.
    """
    rows = tf.cast(rows, tf.int32)
    index = tf.cast(index, tf.int32)
    base, extra = rows // num_shards, rows % num_shards
    start = index * base + tf.minimum(index, extra)
    size = base + tf.cast(index < extra, tf.int32)
    return start, size


def bounds(rows: int, shards: int) -> list[int]:
    """The ``shards + 1`` row boundaries of :func:`shard_bounds`, in Python ints."""
    base, extra = divmod(rows, shards)
    return [k * base + min(k, extra) for k in range(shards + 1)]


def shard_rows(batch: dict, num_shards: int, index: int | tf.Tensor) -> dict:
    """The rows of ``batch`` (``{"inputs", "targets"}`` [B, T], maybe "rows" [B]) that
    belong to share ``index``, with "rows" (kept from ``batch`` when it has them, so a
    share of a share still knows its global rows); one padding row when it has none."""
    start, size = shard_bounds(tf.shape(batch["targets"])[0], num_shards, index)
    if "rows" not in batch:
        batch = with_rows(batch, 0)
    return {key: tf.cond(size > 0, lambda v=value: v[start:start + size],
                         lambda v=value: _pad_row(v))
            for key, value in batch.items()}


def state_rows(state: tf.Tensor, start: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
    """Rows ``start:start+size`` of a [B, H] recurrent state: the state of the share
    ``shard_bounds`` gives; one zero row when ``size`` is 0 (its padding row)."""
    return tf.cond(size > 0, lambda: state[start:start + size],
                   lambda: tf.zeros(tf.concat([[1], tf.shape(state)[1:]], 0), state.dtype))


def state_share(state, shares: int, index: tf.Tensor):
    """Share ``index`` of ``shares`` of a carried state (any nest of [B, H] tensors)."""
    def part(v):
        return state_rows(v, *shard_bounds(tf.shape(v)[0], shares, index))
    return tf.nest.map_structure(part, state)


@dataclasses.dataclass
class Share:
    """One replica's share of a global batch: its rows (:func:`shard_rows`), its rows of
    the carried state (or None) and its real row count ``size`` (int32 scalar)."""

    batch: dict
    state: object
    size: tf.Tensor


def split(batch: dict, state, shares: int) -> list[Share]:
    """``batch`` and ``state`` (a nest of [B, H] tensors, or None) cut into ``shares``
    replica shares, in replica order."""
    rows = tf.shape(batch["targets"])[0]
    out = []
    for i in range(shares):
        start, size = shard_bounds(rows, shares, i)
        part = None if state is None else tf.nest.map_structure(
            lambda s: state_rows(s, start, size), state)
        out.append(Share(shard_rows(batch, shares, i), part, size))
    return out


def join(values: list, sizes: list) -> tf.Tensor:
    """The shares' [b_i, ...] tensors (final states) back into the global batch's rows:
    each share's first ``sizes[i]`` rows (a padding row dropped), concatenated."""
    return tf.concat([v[:n] for v, n in zip(values, sizes)], 0)


def at_least_one_row(batch: dict) -> dict:
    """A batch of no rows becomes one row of padding (zero tokens, zero gradient).

    In a multi-worker sentence-mode epoch each input pipeline reads its own lines, so one
    may run out a step or two before another; ``tf.distribute`` then hands its replicas
    batches of 0 rows until every pipeline has ended (which Keras RNN kernels reject).
    """
    rows = tf.shape(batch["targets"])[0]
    return {k: tf.cond(rows > 0, lambda v=v: v, lambda v=v: _pad_row(v)) for k, v in batch.items()}


def with_rows(batch: dict, first) -> dict:
    """``batch`` with "rows" [b] int32: its rows are global rows ``first, first + 1, …``."""
    return {**batch, "rows": first + tf.range(tf.shape(batch["targets"])[0], dtype=tf.int32)}


def _pad_row(value: tf.Tensor) -> tf.Tensor:
    """One row of padding shaped like ``value``'s rows (at least one time step)."""
    shape = tf.concat([[1], tf.maximum(tf.shape(value)[1:], 1)], axis=0)
    return tf.fill(shape, tf.constant(PAD_ID, value.dtype))


@dataclasses.dataclass(frozen=True)
class Context:
    """The fields of a ``tf.distribute.InputContext`` that this module reads."""

    num_replicas_in_sync: int
    num_input_pipelines: int = 1
    input_pipeline_id: int = 0


def pipeline_rows(batch_size: int, input_context) -> tuple[int, int]:
    """(first global row, rows) of the global batch that ``input_context``'s pipeline
    feeds: the rows of its local replicas."""
    total = input_context.num_replicas_in_sync
    local = total // input_context.num_input_pipelines
    first = input_context.input_pipeline_id * local
    starts = bounds(batch_size, total)
    return starts[first], starts[first + local] - starts[first]


def per_replica(batches: tf.data.Dataset, input_context=None, *,
                rows: tuple[int, int] | None = None) -> tf.data.Dataset:
    """Turns a dataset of batches into this pipeline's replica shares, in order.

    ``rows`` None: the batches are global and each local replica gets its
    ``shard_bounds`` share. ``rows = (first, n)``: the batches hold only this pipeline's
    ``n`` rows of the global batch, starting at global row ``first``; its local replicas
    share them by ``shard_bounds`` (the same rows: shares are contiguous and their sizes
    never grow). With ``input_context`` None (one device) the batches pass unchanged.
    """
    if input_context is None or input_context.num_replicas_in_sync == 1:
        return batches
    total = input_context.num_replicas_in_sync
    local = total // input_context.num_input_pipelines
    first = input_context.input_pipeline_id * local

    if rows is None:
        @tf.autograph.experimental.do_not_convert
        def slices(batch):
            return tf.data.Dataset.range(local).map(
                lambda i: shard_rows(batch, total, tf.cast(first + i, tf.int32)))
    else:
        @tf.autograph.experimental.do_not_convert
        def slices(batch):
            batch = with_rows(batch, rows[0])
            return tf.data.Dataset.range(local).map(
                lambda i: shard_rows(batch, local, tf.cast(i, tf.int32)))

    return batches.flat_map(slices)


def replica_batches(data, split_name: str, *, training: bool, batch_size: int, epoch: int = 0,
                    skip: int = 0, input_context=None) -> tf.data.Dataset:
    """The batches of ``split_name`` for one epoch, as the replicas of
    ``input_context``'s pipeline take them (None: the global batches, for plug-ins that
    split them inside the step).

    Args:
      data: a :class:`tfpar.data.pipeline.InputData`.
      training: shuffle (sentence mode) by file order and a buffer that depend on
        ``epoch``.
      batch_size: the global batch size.
      skip: batches of this pipeline to skip (resuming in the middle of an epoch).
    """
    pipelines = input_context.num_input_pipelines if input_context is not None else 1
    rows = None
    if pipelines > 1 and data.reads_own_lines:
        # Each pipeline reads its own share of the lines and batches its replicas' rows;
        # global row indices key the dropout masks.
        rows = pipeline_rows(batch_size, input_context)
        ds = data.batches(split_name, training=training, epoch=epoch, skip=skip,
                          batch_size=rows[1], pipelines=pipelines,
                          index=input_context.input_pipeline_id)
    else:
        ds = data.batches(split_name, training=training, epoch=epoch, skip=skip,
                          batch_size=batch_size)
    if input_context is None:
        return ds
    return per_replica(ds, input_context, rows=rows).prefetch(tf.data.AUTOTUNE)
