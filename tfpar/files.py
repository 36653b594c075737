"""Paths on any file system TensorFlow can write: local disks and ``scheme://`` URLs.

A model dir, an export dir or a metrics file may be a local path or a URL such as
``gs://bucket/run``, ``s3://bucket/run`` (with ``tensorflow-io``), ``hdfs://namenode/run``
or ``ram://run`` (TensorFlow's in-memory file system, one process only): tfpar reads and
writes them through ``tf.io.gfile``, which picks the file system by the scheme. These
helpers are the few things ``tf.io.gfile`` leaves to its callers.

Never pass such a path to ``os``, ``open``, ``pathlib`` or ``os.path.abspath``:
``Path("ram://x")`` is ``ram:/x``, and ``os.makedirs("ram://x")`` makes a local folder
``./ram:/x``. ``os.path.join`` and ``os.path.dirname`` are safe (URLs use ``/``).

``ram://`` is a test bed, not a store: its ``exists`` and ``isdir`` are true for any
prefix of a path it holds (``ram://d/LOCK`` "exists" beside ``ram://d/LOCK.tmp``), its
``"w"`` mode appends to an existing file, its folder rename moves no files, and it keeps
no modification times. tfpar writes only new files there (then renames them).
"""

from __future__ import annotations

import contextlib
import os
import posixpath

import tensorflow as tf

from tfpar.errors import ConfigError


def is_local(path: str | os.PathLike) -> bool:
    """True for a path on this host's file system, False for a ``scheme://`` URL."""
    return "://" not in os.fspath(path)


def check_file_system(path: str, flag: str) -> None:
    """Refuses a URL whose file system TensorFlow does not have, before anything is
    written. TensorFlow has ``gs://`` and ``ram://``; ``s3://``, ``hdfs://`` and ``az://``
    come with tensorflow-io, imported here when installed (importing registers them).

    Raises:
      ConfigError: naming ``flag``, the path and the file systems there are.
    """
    if is_local(path):
        return
    scheme = path.split("://", 1)[0]
    if scheme not in tf.io.gfile.get_registered_schemes():
        with contextlib.suppress(ImportError):
            import tensorflow_io  # noqa: F401
    schemes = tf.io.gfile.get_registered_schemes()
    if scheme not in schemes:
        known = ", ".join(f"{s}://" for s in sorted(schemes) if s not in ("", "file"))
        raise ConfigError(
            f"{flag} {path!r}: TensorFlow has no file system for {scheme}:// here (it has "
            f"{known} and local paths); s3://, hdfs:// and az:// need tensorflow-io "
            "(pip install tensorflow-io)")


def absolute(path: str) -> str:
    """A local path made absolute; a URL as it is (it is absolute already)."""
    return os.path.abspath(path) if is_local(path) else path


def parent(path: str) -> str | None:
    """The folder holding ``path`` (``gs://b/run`` → ``gs://b``, ``gs://b`` → ``gs://``);
    None for a root (``/``, ``gs://``)."""
    path = path.rstrip("/") or path
    if is_local(path):
        up = os.path.dirname(path)
        return None if up == path else up
    scheme, rest = path.split("://", 1)
    if not rest.strip("/"):
        return None
    return f"{scheme}://{posixpath.dirname(rest)}"


def read_text(path: str) -> str:
    """The UTF-8 text of the file at ``path``."""
    with tf.io.gfile.GFile(path, "rb") as f:
        return f.read().decode("utf-8")


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` atomically: into ``<path>.tmp``, then renamed over
    ``path`` (``rename(2)`` on a local disk; on an object store, whose objects are
    never seen half-written, a copy)."""
    tmp = path + ".tmp"
    with tf.io.gfile.GFile(tmp, "wb") as f:
        f.write(text.encode("utf-8"))
    tf.io.gfile.rename(tmp, path, overwrite=True)


def modified(path: str) -> float | None:
    """When the file at ``path`` was last written (Unix time) by its file system's clock;
    None when the file system does not keep it (``ram://`` reports 0)."""
    nanoseconds = tf.io.gfile.stat(path).mtime_nsec
    return nanoseconds / 1e9 if nanoseconds > 0 else None


def reason(error: Exception) -> str:
    """Why an I/O call failed, on one line: an ``OSError``'s ``strerror`` or a TensorFlow
    error's message (for a local path ``"<path>; No such file or directory"`` becomes
    ``"No such file or directory"``)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = (getattr(error, "message", None) or str(error)).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    head, sep, tail = line.rpartition("; ")
    return tail if sep and head and not any(c.isspace() for c in head) else line
