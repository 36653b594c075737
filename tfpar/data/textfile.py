"""Reading a user's UTF-8 text file (a corpus split, a vocabulary) with one-line errors.

The one place that turns "cannot read", "is a folder", "is binary" and "is not UTF-8"
into :class:`~tfpar.errors.DataError` messages that name the file and say what it
must be, so corpora and vocabularies report a bad file the same way. A file given by a
URL (``gs://…``, ``ram://…``: a vocabulary saved in such a model dir) is read through
``tf.io.gfile``.
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from tfpar import files
from tfpar.errors import DataError


def read_text(file: Path, what: str, *, holds: str) -> str:
    """The decoded text of ``file``.

    Args:
      file: the path.
      what: how messages name the file: ``"{what} file {file} ..."`` ("train", "corpus",
        "vocabulary").
      holds: what each line of a good file holds, for the advice ("one sentence per line").

    Raises:
      DataError: the file does not exist, is a folder or unreadable, holds a NUL byte
        (binary) or is not UTF-8. A UTF-8 byte-order mark is dropped.
    """
    return _decode(_read_bytes(file, what, holds), file, what, holds)


# check_text_file reads files up to this size whole; of larger ones, check_text_prefix.
CHECKED_BYTES = 64 << 20


def check_text_file(file: Path, what: str, *, holds: str, needs_text: bool = True) -> None:
    """Checks that ``file`` is UTF-8 text with at least one non-blank line, without
    keeping it: a file up to CHECKED_BYTES is read whole, a larger one only as
    :func:`check_text_prefix` does (a corpus file of gigabytes is sniffed, not read twice:
    the input pipeline streams it later).

    Raises:
      DataError: as :func:`read_text`, or (``needs_text``) ``"{what} split {file} has no
        sentences"``.
    """
    if _size(file, what, holds) > CHECKED_BYTES:
        check_text_prefix(file, what, holds=holds)
        return
    text = _decode(_read_bytes(file, what, holds), file, what, holds)
    if needs_text and not text.strip():
        raise DataError(
            f"{what} split {file} has no sentences (it is empty or holds only blank lines); "
            f"it needs {holds}")


def _size(file: Path, what: str, holds: str) -> int:
    try:
        return file.stat().st_size
    except FileNotFoundError:
        raise DataError(
            f"{what} file {file} does not exist; give the path of a UTF-8 text file with "
            f"{holds}") from None
    except OSError as e:
        raise DataError(f"cannot read {what} file {file}: {e.strerror or e}") from None


# How much of a file check_text_prefix reads: like git, which calls a file binary when
# its first 8,000 bytes hold a NUL, a few KB decide; a 500 MB shard is never read whole.
PREFIX_BYTES = 8192


def check_text_prefix(file: Path, what: str, *, holds: str,
                      size: int = PREFIX_BYTES) -> None:
    """Checks that ``file`` is readable and its first ``size`` bytes are UTF-8 text.

    For shards too large to read here (the input pipeline streams them later): the
    messages are :func:`read_text`'s, but only a prefix is read, so a bad byte past it is
    found by the pipeline, not here.

    Args:
      file: the path.
      what: how messages name the file (``"train"``, ``"valid"``, ``"test"``).
      holds: what each line of a good file holds, for the advice.
      size: how many bytes to check.

    Raises:
      DataError: as :func:`read_text`, for the prefix.
    """
    prefix = _read_bytes(file, what, holds, limit=size + 1)
    if len(prefix) > size:
        # The file goes on past the prefix, which may end inside a multi-byte character:
        # drop a lead byte and the continuation bytes that follow it if they are fewer
        # than it announces (a lone continuation byte is still caught by the decoder).
        prefix = prefix[:size]
        for back in range(1, min(4, len(prefix)) + 1):
            byte = prefix[-back]
            if byte & 0xC0 != 0x80:  # a lead (or ASCII) byte
                length = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
                if length > back:
                    prefix = prefix[:-back]
                break
    _decode(prefix, file, what, holds)


def _read_bytes(file: Path | str, what: str, holds: str, limit: int | None = None) -> bytes:
    if not files.is_local(file):
        return _read_url(file, what, holds, limit)
    try:
        if limit is None:
            return file.read_bytes()
        with file.open("rb") as f:
            return f.read(limit)
    except FileNotFoundError:
        raise DataError(
            f"{what} file {file} does not exist; give the path of a UTF-8 text file with "
            f"{holds}") from None
    except PermissionError:
        raise DataError(
            f"cannot read {what} file {file}: permission denied; make it readable "
            f"(e.g. chmod a+r {file})") from None
    except IsADirectoryError:
        raise DataError(
            f"{what} file {file} is a folder; it must be a UTF-8 text file with {holds}") from None
    except OSError as e:
        raise DataError(f"cannot read {what} file {file}: {e.strerror or e}") from None


def _read_url(url: str, what: str, holds: str, limit: int | None) -> bytes:
    """``_read_bytes`` of a file given by a URL (``gs://…``, ``ram://…``), via tf.io.gfile."""
    try:
        if tf.io.gfile.isdir(url):
            raise DataError(
                f"{what} file {url} is a folder; it must be a UTF-8 text file with {holds}")
        with tf.io.gfile.GFile(url, "rb") as f:
            return f.read(-1 if limit is None else limit)
    except tf.errors.NotFoundError:
        raise DataError(
            f"{what} file {url} does not exist; give the path of a UTF-8 text file with "
            f"{holds}") from None
    except tf.errors.OpError as e:
        raise DataError(f"cannot read {what} file {url}: {files.reason(e)}") from None


def _decode(data: bytes, file: Path, what: str, holds: str) -> str:
    # A NUL byte is valid UTF-8 but never occurs in text, so it is the cheap sign of a
    # binary file (an archive or a saved array) given by mistake.
    nul = data.find(b"\0")
    if nul >= 0:
        raise DataError(
            f"{what} file {file} is binary, not text (NUL byte at offset {nul}); it must be "
            f"UTF-8 text with {holds}")
    try:
        # utf-8-sig drops a byte-order mark that some editors write, which would otherwise
        # stick to the first token.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{what} file {file} is not UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} "
            "cannot be decoded; re-encode the file as UTF-8 (e.g. iconv -t UTF-8)") from None
