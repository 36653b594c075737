"""Text on disk as ``tf.data``: a split is byte ranges of files, read line by line.

Nothing here holds a split in memory. A :class:`TextSplit` is a tuple of
:class:`Segment` s, each a byte range ``[start, end)`` of one file that begins at a line
start; a whole file is one segment. :func:`line_batches` reads segments with
``tf.data.FixedLengthRecordDataset`` (which seeks to ``start``) and cuts the records into
lines in TF ops, so reading a range in the middle of a 10 GB file costs only that range::

    file:      |line 0\\nline 1\\nline 2\\nline 3\\nline 4\\n|
    segments:  [---- row 0 ---------)[---- row 1 ----------)     (cut: about equal bytes,
                                                              moved to the next line start)
    records:   [64 KiB][64 KiB] ... [rest]["\\n"]              (one final "\\n": a last line
                                                              without a line break ends too)

Lines are stripped of surrounding whitespace and blank lines are dropped, everywhere.

In-memory text (the synthetic corpus, a TFDS dataset, the lists tests pass) is written
once to a temporary folder by :func:`write_splits` and then read like any other file, so
there is one input pipeline, not two.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import tensorflow as tf

# Bytes per record read by line_batches; each becomes one batch of lines.
RECORD_BYTES = 1 << 16
BOM = "\ufeff".encode("utf-8")


@dataclasses.dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of the file at ``path``; ``start`` is a line start."""

    path: str
    start: int
    end: int
    # The file's size when the segment was made (FixedLengthRecordDataset's footer).
    size: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class TextSplit:
    """One split of a corpus: its segments, read in this order."""

    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.path for s in self.segments))

    def describe(self) -> str:
        """``"3 files, 12.3 MB"``, for log lines."""
        n = len(self.files)
        return f"{n} file{'s' * (n != 1)}, {self.nbytes / 1e6:.1f} MB"

    @classmethod
    def of_files(cls, paths: Iterable[str | os.PathLike]) -> "TextSplit":
        """Whole files, in the given order."""
        segments = []
        for path in paths:
            size = os.path.getsize(path)
            with open(path, "rb") as f:  # a UTF-8 byte-order mark is not text
                start = len(BOM) if f.read(len(BOM)) == BOM else 0
            segments.append(Segment(os.fspath(path), start, size, size))
        return cls(tuple(segments))


# ----------------------------------------------------------------------------- cutting
def next_line_start(path: str, offset: int, size: int) -> int:
    """The first line start at or after byte ``offset`` of ``path`` (``size`` at the end).

    Reads forward from ``offset - 1`` to the next ``\\n``: a few bytes, whatever the file's
    size.
    """
    if offset <= 0:
        return 0
    if offset >= size:
        return size
    with open(path, "rb") as f:
        f.seek(offset - 1)
        position = offset - 1
        while True:
            chunk = f.read(1 << 16)
            if not chunk:
                return size
            newline = chunk.find(b"\n")
            if newline >= 0:
                return position + newline + 1
            position += len(chunk)


def cut(split: TextSplit, parts: int) -> list[TextSplit]:
    """``split`` cut into ``parts`` contiguous pieces of about equal bytes, each at line
    starts (a piece may be empty when lines are longer than a share)."""
    total = split.nbytes
    bounds = [total * k // parts for k in range(parts + 1)]
    # Global byte offset -> (segment, offset in it), moved to a line start.
    starts, acc = [], 0
    for seg in split.segments:
        starts.append(acc)
        acc += seg.nbytes

    def locate(offset: int) -> int:
        """The global offset of the first line start at or after ``offset``."""
        for base, seg in zip(starts, split.segments):
            if offset < base + seg.nbytes:
                inner = next_line_start(seg.path, seg.start + offset - base, seg.end)
                return base + inner - seg.start
        return total

    cuts = [0] + [locate(b) for b in bounds[1:-1]] + [total]
    cuts = [int(c) for c in np.maximum.accumulate(cuts)]
    pieces = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        segments = []
        for base, seg in zip(starts, split.segments):
            a, b = max(lo, base), min(hi, base + seg.nbytes)
            if a < b:
                segments.append(Segment(seg.path, seg.start + a - base, seg.start + b - base,
                                        seg.size))
        pieces.append(TextSplit(tuple(segments)))
    return pieces


# ----------------------------------------------------------------------------- reading
@tf.autograph.experimental.do_not_convert
def _segment_records(path, start, end, size) -> tf.data.Dataset:
    """Bytes ``[start, end)`` of ``path`` (``size`` bytes) as string records of at most
    RECORD_BYTES, then one "\\n". Tensors in, so one trace serves every segment."""
    full = (end - start) // RECORD_BYTES
    rest = end - start - full * RECORD_BYTES
    whole = tf.data.FixedLengthRecordDataset(
        path, RECORD_BYTES, header_bytes=start, footer_bytes=size - start - full * RECORD_BYTES)
    tail = tf.data.FixedLengthRecordDataset(
        path, tf.maximum(rest, 1), header_bytes=start + full * RECORD_BYTES,
        footer_bytes=size - end).take(tf.cast(rest > 0, tf.int64))
    return whole.concatenate(tail).concatenate(tf.data.Dataset.from_tensors(tf.constant("\n")))


@tf.autograph.experimental.do_not_convert
def _lines_of_records(records: tf.data.Dataset) -> tf.data.Dataset:
    """Records → [k] string batches of the lines that end in each record: a line cut by
    a record's end is carried into the next record."""

    @tf.autograph.experimental.do_not_convert
    def split(left, record):
        pieces = tf.strings.split(left + record, "\n")
        return pieces[-1], pieces[:-1]

    return records.scan(tf.constant("", tf.string), split)


@tf.autograph.experimental.do_not_convert
def non_blank(lines: tf.Tensor) -> tf.Tensor:
    """[k] lines → the stripped non-blank ones, in order."""
    stripped = tf.strings.strip(lines)
    return tf.boolean_mask(stripped, tf.strings.length(stripped) > 0)


def segment_table(segments: Sequence[Segment]) -> tf.data.Dataset:
    """(path, start, end, size) of every segment, as a dataset of tensors."""
    return tf.data.Dataset.from_tensor_slices((
        tf.constant([s.path for s in segments], tf.string),
        tf.constant([s.start for s in segments], tf.int64),
        tf.constant([s.end for s in segments], tf.int64),
        tf.constant([s.size for s in segments], tf.int64)))


@tf.function(autograph=False, input_signature=[
    tf.TensorSpec([], tf.string), *[tf.TensorSpec([], tf.int64)] * 3])
def segment_lines(path, start, end, size) -> tf.data.Dataset:
    """[k] string batches of one segment's stripped, non-blank lines. A ``tf.function``
    of tensors alone: its reader is traced once per process, whatever the split, and each
    pipeline that reads segments calls that trace."""
    return _lines_of_records(_segment_records(path, start, end, size)).map(non_blank)


def line_batches(split: TextSplit, *, interleave: bool = False,
                 share: tuple[int, int | tf.Tensor] | None = None) -> tf.data.Dataset:
    """[k] string batches of ``split``'s stripped, non-blank lines (a batch per record;
    it may be empty).

    In file order; with ``interleave``, every segment read is open at once and they are
    read in turn, one record's lines each (a deterministic order, for a sentence-mode
    epoch that draws on every shard at once). ``share = (n, i)`` reads only segments
    ``i, i + n, ...``; ``i`` may be a tensor (a parameter-server worker's index). One
    reader function, traced once, reads every segment, so a split of a thousand shards
    builds as fast as one of one.
    """
    if not split.segments:
        return tf.data.Dataset.from_tensors(tf.constant([], tf.string)).take(0)
    table, count = segment_table(split.segments), len(split.segments)
    if share is not None:
        table, count = table.shard(*share), -(-count // share[0])
    return table.interleave(segment_lines, cycle_length=count if interleave else 1,
                            block_length=1)


def lines(split: TextSplit) -> tf.data.Dataset:
    """``split``'s stripped, non-blank lines, one string per element, in file order."""
    return line_batches(split).unbatch()


def iterate_lines(split: TextSplit) -> Iterator[str]:
    """The lines of ``split`` as Python strings (for tools and small splits)."""
    for batch in line_batches(split).as_numpy_iterator():
        for line in batch:
            yield line.decode("utf-8")


# ----------------------------------------------------------------------------- writing
_TEMP: list[str] = []


def _remove_temp() -> None:
    for folder in _TEMP:
        shutil.rmtree(folder, ignore_errors=True)


atexit.register(_remove_temp)


def write_splits(splits: dict[str, Sequence[str]], folder: str | os.PathLike | None = None
                 ) -> dict[str, TextSplit]:
    """Writes in-memory splits (lists of lines) as ``{split}.txt`` files and returns them
    as TextSplits. ``folder`` None: a temporary folder removed when the process exits."""
    if folder is None:
        folder = tempfile.mkdtemp(prefix="tfpar-text-")
        _TEMP.append(folder)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, split_lines in splits.items():
        path = folder / f"{name}.txt"
        with open(path, "w", encoding="utf-8") as f:
            for line in split_lines:
                f.write(line.replace("\n", " ") + "\n")
        out[name] = TextSplit.of_files([path])
    return out
