"""Where text comes from: corpus folders (PTB, WikiText-2, your own), one text file, TFDS.

Every source becomes a :class:`Corpus`: three splits, each a list of file byte ranges
(``tfpar.data.text.TextSplit``) that the input pipeline streams line by line; a line is a
sentence, stripped of surrounding whitespace, and blank lines are dropped. Nothing here
reads a whole corpus into memory. This module never tokenises (``tfpar.data.tokenize``
does) or builds a vocabulary.

A corpus folder holds three UTF-8 text files, one sentence per line, named by one of
:data:`SPLIT_PATTERNS`::

    input/ptb/ptb.{train,valid,test}.txt
    input/wikitext-2/wiki.{train,valid,test}.tokens
    my_corpus/{train,valid,test}.txt

One UTF-8 text file (``--data input.txt``) is cut into three contiguous blocks of its
non-blank lines, train first, then valid, then test, by ``split_fractions``; block ``k``
ends at line ``floor(n * (f_0 + … + f_k) + 0.5)`` of ``n`` (see :func:`split_bounds`)::

    lines:  0 ............................ 89 | 90 ... 94 | 95 ... 99     (n = 100)
            train (0.9)                        valid (0.05) test (0.05)

The generated ``synthetic`` corpus lives in ``tfpar.data.synthetic``, not here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Iterable

from tfpar.config import SPLIT_FRACTIONS, check_split_fractions
from tfpar.data import layouts
from tfpar.data.layouts import SENTENCE_PER_LINE, SPLIT_PATTERNS, SPLITS
from tfpar.data.text import Segment, TextSplit, iterate_lines, write_splits
from tfpar.data.textfile import check_text_file
from tfpar.errors import DataError, command

logger = logging.getLogger(__name__)

TFDS_PREFIX = "tfds:"

# TFDS split names that fill each Corpus split, in order of preference.
_TFDS_SPLITS = {"train": ("train",), "valid": ("validation", "valid", "dev"), "test": ("test",)}

# How many file names an error message lists before it says "and N more".
_LISTED_NAMES = 5


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Three splits of one source, each a :class:`tfpar.data.text.TextSplit`: byte
    ranges of files, read line by line when a pipeline runs, never held in memory."""

    # "ptb", "wikitext-2", "tfds:tiny_shakespeare", or the folder (file) name for --data
    # DIR (--data FILE).
    name: str
    # Out of repr: a corpus of 100 shards would fill a log line.
    train: TextSplit = dataclasses.field(repr=False)
    valid: TextSplit = dataclasses.field(repr=False)
    test: TextSplit = dataclasses.field(repr=False)

    def lines(self, split: str) -> list[str]:
        """The stripped, non-blank lines of ``split`` (reads them; for tests and tools)."""
        return list(iterate_lines(getattr(self, split)))


@dataclasses.dataclass(frozen=True)
class CorpusFile:
    """One split file of a corpus that tfpar knows how to download."""

    # "train", "valid" or "test".
    split: str
    # File name inside input/<corpus>/.
    filename: str
    # sha256 of the file's bytes, from /work/shared/data/README.md.
    sha256: str


@dataclasses.dataclass(frozen=True)
class KnownCorpus:
    """A corpus that ``--data NAME`` finds in ``input/NAME/``."""

    # Canonical name, also the folder name under input/.
    name: str
    # Its three split files, in SPLITS order.
    files: tuple[CorpusFile, ...]


# The one table of known corpora and their checksums; scripts/download_data.py verifies
# downloads against it (and its tests swap in tiny files through this dict).
KNOWN_CORPORA: dict[str, KnownCorpus] = {
    "ptb": KnownCorpus("ptb", (
        CorpusFile("train", "ptb.train.txt",
                   "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf"),
        CorpusFile("valid", "ptb.valid.txt",
                   "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
        CorpusFile("test", "ptb.test.txt",
                   "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"),
    )),
    "wikitext-2": KnownCorpus("wikitext-2", (
        CorpusFile("train", "wiki.train.tokens",
                   "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f"),
        CorpusFile("valid", "wiki.valid.tokens",
                   "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"),
        CorpusFile("test", "wiki.test.tokens",
                   "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"),
    )),
}

# Other spellings accepted for a known corpus name.
ALIASES = {"wikitext2": "wikitext-2"}


@dataclasses.dataclass(frozen=True)
class KnownArchive:
    """A corpus published as one archive, which ``tfpar-download`` unpacks."""

    # Canonical name, also the folder name under input/.
    name: str
    # The archive's file name on the server and while it is downloaded.
    filename: str
    # sha256 of the archive's bytes; its source is given beside each entry.
    sha256: str
    # The archive's size in bytes, for the download's progress lines.
    size: int


# Corpora that download as one archive; scripts/download_data.py verifies them against
# this table (its tests swap in a tiny archive through this dict). Their layouts are
# read by tfpar.data.layouts.
KNOWN_ARCHIVES: dict[str, KnownArchive] = {
    # The One Billion Word Benchmark, release r13output, from
    # http://www.statmt.org/lm-benchmark/. The sha256 and size are those TensorFlow
    # Datasets pins for this URL (tensorflow/datasets, url_checksums/lm1b.txt); tfpar has
    # not downloaded the archive to check them, but every download is checked against them.
    "lm1b": KnownArchive(
        "lm1b", "1-billion-word-language-modeling-benchmark-r13output.tar.gz",
        "01ba60381110baf7f189dfd2b8374de371e8c9a340835793f190bdae9e90a34e", 1_792_209_805),
}


def canonical_name(name: str) -> str | None:
    """Returns the canonical known-corpus name for ``name`` or an alias, else None."""
    name = ALIASES.get(name, name)
    return name if name in KNOWN_CORPORA else None


def _known_names() -> str:
    return ", ".join([*KNOWN_CORPORA, *ALIASES])


def _sentences(lines: Iterable[str]) -> list[str]:
    """Strips each line and drops the blank ones."""
    return [s for s in (line.strip() for line in lines) if s]


def _read_split(files: list[Path], split: str) -> TextSplit:
    """A split's files as a TextSplit; one file is checked whole (``check_text_file``),
    shards were sniffed by ``tfpar.data.layouts``."""
    if len(files) == 1:
        check_text_file(files[0], split, holds=SENTENCE_PER_LINE)
    return TextSplit.of_files(files)


def read_text_dir(path: str | os.PathLike) -> Corpus:
    """The corpus in a folder, or given by split globs (``tfpar.data.layouts``).

    Args:
        path: A folder in one of ``tfpar.data.layouts``' layouts (three files named by
            :data:`SPLIT_PATTERNS`, such as ``ptb.train.txt``; ``train/ valid/ test/``
            folders of shards; lm1b's release), or ``train=GLOB,valid=GLOB,test=GLOB``.

    Returns:
        The corpus, named after the folder (``"globs"`` for globs). Every split lists its
        files; a split of one file up to 64 MB is checked whole (UTF-8, not binary, not
        blank), shards by their first bytes.

    Raises:
        DataError: If the folder is missing or a file, no layout fits, a glob matches
            nothing, a file cannot be read, is binary or not UTF-8, or a split holds no
            sentences.
    """
    files = layouts.find_split_files(path)
    splits = {split: _read_split(paths, split) for split, paths in files.items()}
    globs = layouts.parse_split_globs(os.fspath(path)) is not None and not os.path.exists(path)
    name = "globs" if globs else Path(os.path.abspath(path)).name
    corpus = Corpus(name=name, **splits)
    logger.info("Corpus %s in %s: %s (train/valid/test)", corpus.name, path,
                "; ".join(splits[s].describe() for s in SPLITS))
    return corpus


def split_bounds(n: int, fractions: tuple[float, ...]) -> tuple[int, int]:
    """Where train ends and test begins among ``n`` lines cut by ``fractions``.

    Returns ``(b1, b2)``: train is lines ``[0, b1)``, valid ``[b1, b2)``, test ``[b2, n)``,
    with ``b_k = floor(n * (f_0 + … + f_{k-1}) + 0.5)``: cumulative rounding, so the three
    counts always add up to ``n`` and each is within one line of ``n * f_k``.
    """
    b1 = math.floor(n * fractions[0] + 0.5)
    b2 = math.floor(n * (fractions[0] + fractions[1]) + 0.5)
    return min(b1, n), min(max(b2, b1), n)


def _lines_needed(fractions: tuple[float, ...]) -> int:
    """The least ``n`` from which on every line count gives every split a line.

    ``n * f_k >= 1`` for every k is enough (cumulative rounding then gives split k at
    least one line); below that, counts are tried one by one.
    """
    def fits(n: int) -> bool:
        b1, b2 = split_bounds(n, fractions)
        return 0 < b1 < b2 < n

    n = math.ceil(1 / min(fractions)) + 1  # +1: room for float rounding of n * f
    while n > 3 and fits(n - 1):
        n -= 1
    return n


def read_text_file(path: str | os.PathLike,
                   split_fractions: tuple[float, ...] = SPLIT_FRACTIONS) -> Corpus:
    """Reads one text file and cuts its lines into train, valid and test.

    Args:
        path: A UTF-8 text file, one sentence per line.
        split_fractions: The train, valid and test shares of the file's non-blank lines,
            each > 0, summing to 1; the splits are contiguous blocks in that order (see
            :func:`split_bounds`), so the same file always gives the same splits.

    Returns:
        The corpus, named after the file. Blank lines are dropped first; other lines
        stripped.

    Raises:
        ConfigError: If the fractions are not three positive numbers summing to 1.
        DataError: If the file cannot be read, is binary or not UTF-8, or has too few
            non-blank lines to give every split one.
    """
    check_split_fractions(tuple(split_fractions))
    file = Path(path)
    check_text_file(file, "corpus", holds=SENTENCE_PER_LINE, needs_text=False)
    n = _count_non_blank(file)
    b1, b2 = split_bounds(n, split_fractions)
    counts = (b1, b2 - b1, n - b2)
    shown = ",".join(f"{f:g}" for f in split_fractions)
    if min(counts) == 0:
        raise DataError(
            f"corpus file {file} has {n} non-blank lines, too few to cut by "
            f"--split-fractions {shown} (train/valid/test would get "
            f"{'/'.join(map(str, counts))} lines); it needs at least "
            f"{_lines_needed(split_fractions)} lines, or give larger valid/test fractions")
    size = file.stat().st_size
    start = TextSplit.of_files([file]).segments[0].start  # after a byte-order mark
    o1, o2 = _offsets_of_lines(file, (b1, b2))
    splits = {name: TextSplit((Segment(os.fspath(file), a, b, size),))
              for name, (a, b) in zip(SPLITS, ((start, o1), (o1, o2), (o2, size)))}
    corpus = Corpus(name=Path(os.path.abspath(file)).name, **splits)
    logger.info("Split corpus file %s by fractions %s: %s lines (train/valid/test)", file,
                shown, "/".join(map(str, counts)))
    return corpus


def _count_non_blank(file: Path) -> int:
    """Non-blank lines of ``file``: one pass, a line at a time (memory stays flat)."""
    with open(file, "rb") as f:
        return sum(1 for line in f if line.strip())


def _offsets_of_lines(file: Path, indices: tuple[int, ...]) -> list[int]:
    """Byte offsets where non-blank lines ``indices`` (ascending) start."""
    offsets, wanted, position, k = [], list(indices), 0, 0
    with open(file, "rb") as f:
        for line in f:
            if wanted and line.strip():
                if k == wanted[0]:
                    offsets.append(position)
                    wanted.pop(0)
                k += 1
            if not wanted:
                break
            position += len(line)
    return offsets + [position] * len(wanted)


def resolve_named(name: str, *, input_dir: str | os.PathLike = "input") -> Corpus:
    """Reads a known corpus from ``input_dir/<name>/``.

    Args:
        name: A known corpus name (``ptb``, ``wikitext-2``, ``lm1b``) or an alias
            (``wikitext2``).
        input_dir: The folder that holds one subfolder per named corpus.

    Returns:
        The corpus, named by its canonical name.

    Raises:
        DataError: If the name is unknown, its folder is missing (the message says how to
            download it), or the folder cannot be read (see :func:`read_text_dir`).
    """
    # An archive corpus (lm1b) is found the same way, its folder read as a layout.
    canonical = canonical_name(name) or (name if name in KNOWN_ARCHIVES else None)
    if canonical is None:
        raise DataError(
            f"unknown corpus name {name!r}; expected one of: {_known_names()} (or pass "
            "--data DIR or --data tfds:NAME)")
    folder = Path(input_dir) / canonical
    if not folder.exists():
        flag = "" if str(input_dir) == "input" else f" --input-dir {input_dir}"
        raise DataError(
            f"corpus {canonical!r} is missing: {folder} does not exist; download it with: "
            f"{command('tfpar-download', canonical + flag)}, or pass --data DIR")
    return dataclasses.replace(read_text_dir(folder), name=canonical)


def _tfds_builder(tfds, name: str, data_dir: str | None):
    try:
        return tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:
        raise DataError(
            f"unknown TFDS dataset {name!r}; pass tfds:NAME with a text dataset from "
            "tfds.list_builders(), e.g. tfds:tiny_shakespeare") from None
    except ValueError as e:
        # TFDS messages run to many lines (all configs, all datasets); keep the first.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"TFDS dataset {name!r} cannot be built: {first}; expected "
            "NAME[/CONFIG][:VERSION], e.g. tiny_shakespeare") from None


def _check_text_feature(tfds, builder, name: str) -> None:
    features = builder.info.features
    keys = list(features.keys()) if isinstance(features, tfds.features.FeaturesDict) else []
    if "text" not in keys or not isinstance(features["text"], tfds.features.Text):
        raise DataError(
            f"TFDS dataset {name!r} has no 'text' feature (it has: {', '.join(keys) or 'none'}); "
            "tfpar reads text datasets such as tiny_shakespeare or lm1b")


def _tfds_split_name(builder, name: str, split: str) -> str:
    """Picks the TFDS split for a Corpus split, checking it exists when TFDS knows."""
    candidates = _TFDS_SPLITS[split]
    # A builder knows its splits only once prepared (and not under tfds.testing.mock_data);
    # otherwise the first candidate is tried and as_dataset reports what is wrong.
    known = list(builder.info.splits.keys())
    if not known:
        return candidates[0]
    for candidate in candidates:
        if candidate in known:
            return candidate
    raise DataError(
        f"TFDS dataset {name!r} has no {' or '.join(map(repr, candidates))} split; it has: "
        f"{', '.join(known)}; tfpar needs train, validation and test splits")


def _not_prepared(builder, name: str, data_dir: str | None) -> DataError:
    where = data_dir or getattr(builder, "data_dir_root", None) or "TFDS's default data_dir"
    arg = f", data_dir={data_dir!r}" if data_dir else ""
    return DataError(
        f"TFDS dataset {name!r} is not prepared in {where} and tfpar does not download during "
        "training; prepare it online first with: python -c \"import tensorflow_datasets as "
        f"tfds; tfds.load({name!r}{arg})\"")


def _tfds_sentences(tfds, builder, name: str, split: str, data_dir: str | None) -> list[str]:
    tfds_split = _tfds_split_name(builder, name, split)
    try:
        ds = builder.as_dataset(split=tfds_split, shuffle_files=False)
    except AssertionError:
        # TFDS signals "no prepared data in data_dir" with an AssertionError.
        raise _not_prepared(builder, name, data_dir) from None
    # Batching strings in TF first makes the Python loop run once per 1024 examples
    # rather than once per example, which matters for lm1b's 30M sentences.
    texts = ds.map(lambda example: example["text"]).batch(1024)
    sentences: list[str] = []
    for batch in tfds.as_numpy(texts):
        for text in batch:
            try:
                sentences.extend(_sentences(text.decode("utf-8").split("\n")))
            except UnicodeDecodeError as e:
                raise DataError(
                    f"TFDS dataset {name!r} split {tfds_split!r} holds text that is not UTF-8 "
                    f"(byte offset {e.start} of an example); tfpar needs UTF-8 text") from None
    if not sentences:
        raise DataError(
            f"TFDS dataset {name!r} split {tfds_split!r} has no sentences (only blank text); "
            "it needs non-blank lines of text")
    return sentences


def load_tfds(name: str, *, data_dir: str | None = None) -> Corpus:
    """Reads a prepared TensorFlow Datasets text dataset; never downloads.

    The dataset's examples must have a ``text`` feature (other features are ignored).
    Each example's text is split on newlines into sentences, so tiny_shakespeare (one
    example per split) gives one sentence per line of the play. TFDS splits ``train``,
    ``validation`` (or ``valid``/``dev``) and ``test`` fill train, valid and test.

    Args:
        name: A TFDS name, ``NAME[/CONFIG][:VERSION]``, e.g. ``tiny_shakespeare``.
        data_dir: TFDS data folder; None uses TFDS's default (``$TFDS_DATA_DIR`` or
            ``~/tensorflow_datasets``).

    Returns:
        The corpus, named ``tfds:NAME``.

    Raises:
        DataError: If the dataset is unknown, has no ``text`` feature, lacks a split, or
            is not prepared in ``data_dir`` (the message says how to prepare it online).
    """
    try:  # Imported here: it takes seconds, and it is an optional dependency.
        import tensorflow_datasets as tfds
    except ImportError:
        raise DataError(f"--data {TFDS_PREFIX}{name} needs the tensorflow-datasets package, "
                        "which is not installed; install it with: pip install "
                        "'tfpar[tfds]' (or pip install tensorflow-datasets)") from None

    builder = _tfds_builder(tfds, name, data_dir)
    _check_text_feature(tfds, builder, name)
    sentences = {split: _tfds_sentences(tfds, builder, name, split, data_dir)
                 for split in SPLITS}
    logger.info("Read TFDS corpus %s: %s sentences (train/valid/test)", name,
                "/".join(str(len(sentences[s])) for s in SPLITS))
    # Written to a temporary folder once, then streamed like any corpus.
    corpus = Corpus(name=f"{TFDS_PREFIX}{name}", **write_splits(sentences))
    return corpus


def load_text_corpus(source: str, *, input_dir: str | os.PathLike = "input",
                     tfds_data_dir: str | None = None,
                     split_fractions: tuple[float, ...] = SPLIT_FRACTIONS) -> Corpus:
    """Reads the corpus that ``--data SOURCE`` names.

    Args:
        source: ``tfds:NAME`` (see :func:`load_tfds`), a known corpus name found in
            ``input_dir`` (see :func:`resolve_named`), a folder path (see
            :func:`read_text_dir`) or a file path (see :func:`read_text_file`).
            ``synthetic`` is handled by the caller, not here.
        input_dir: The folder that holds one subfolder per named corpus.
        tfds_data_dir: TFDS data folder for ``tfds:NAME``; None uses TFDS's default.
        split_fractions: How a file source is cut into train, valid and test.

    Returns:
        The corpus.

    Raises:
        DataError: If the source names nothing readable; the message says what would be.
    """
    if source.startswith(TFDS_PREFIX):
        name = source[len(TFDS_PREFIX):]
        if not name:
            raise DataError(
                f"data source {source!r} names no TFDS dataset; use tfds:NAME, "
                "e.g. tfds:tiny_shakespeare")
        return load_tfds(name, data_dir=tfds_data_dir)
    if canonical_name(source) is not None or source in KNOWN_ARCHIVES:
        return resolve_named(source, input_dir=input_dir)
    if layouts.parse_split_globs(source) is not None and not os.path.exists(source):
        return read_text_dir(source)
    if not os.path.exists(source):
        raise DataError(
            f"data source {source!r} is not a known corpus ({_known_names()}), not tfds:NAME "
            "and not an existing folder or file; pass one of those")
    if os.path.isfile(source):
        return read_text_file(source, split_fractions)
    return read_text_dir(source)
