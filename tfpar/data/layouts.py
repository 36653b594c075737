"""Which text files make up each split of a ``--data`` source: folders, globs, lm1b.

The input pipeline streams a list of files per split; this module finds those lists and
checks that each file is readable and starts like UTF-8 text (its first
:data:`~tfpar.data.textfile.PREFIX_BYTES` only, so a 40 MB shard is never read here).
It reads no sentences and builds no vocabulary.

``--data FOLDER`` is matched against these layouts, in this order (the first that fits
wins, so a folder that works today keeps working)::

    flat files      ptb.{train,valid,test}.txt | wiki.{train,valid,test}.tokens |
                    {train,valid,test}.txt      (SPLIT_PATTERNS)      -> one file a split
    split folders   train/  valid/  test/       -> every regular, non-hidden file directly
                                                   inside each, sorted by name
    lm1b            training-monolingual.tokenized.shuffled/
                        news.en-00001-of-00100 … news.en-00099-of-00100  -> train (all present)
                    heldout-monolingual.tokenized.shuffled/
                        news.en.heldout-00001-of-00050                   -> valid
                        news.en.heldout-00000-of-00050                   -> test

The lm1b layout is the release's ``1-billion-word-language-modeling-benchmark-r13output/``
folder, ``input/lm1b/`` as ``scripts/download_data.py lm1b`` writes it, or a folder that
holds the release's folder. Its test split is held-out shard 00000, as in Chelba et al.'s
benchmark, Jozefowicz et al. (``rafaljozefowicz/lm``) and TensorFlow's ``lm_1b``, so
perplexities compare with theirs; valid is shard 00001, and shards 00002-00049 are unused.
(TFDS's ``lm1b`` instead tests on all 50 held-out shards.)

``--data 'train=GLOB,valid=GLOB,test=GLOB'`` gives each split a glob instead (see
:func:`parse_split_globs`), relative to the working directory unless absolute; ``**``
matches any depth of folders.

Every problem is a one-line :class:`~tfpar.errors.DataError` naming the bad path or glob.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from pathlib import Path
from typing import Mapping

from tfpar.data.textfile import check_text_prefix
from tfpar.errors import DataError, command

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")

# File names of a corpus folder, tried in this order ("{}" is the split name). The first
# pattern whose train file exists decides the names of valid and test too, so a folder
# never mixes, say, ptb.train.txt with valid.txt.
SPLIT_PATTERNS = ("ptb.{}.txt", "wiki.{}.tokens", "{}.txt")
# What a corpus file holds, for the advice of read_text's errors.
SENTENCE_PER_LINE = "one sentence per line"


# The folder the lm1b release unpacks to, and its two folders of shards.
LM1B_RELEASE_FOLDER = "1-billion-word-language-modeling-benchmark-r13output"
LM1B_TRAIN_FOLDER = "training-monolingual.tokenized.shuffled"
LM1B_HELDOUT_FOLDER = "heldout-monolingual.tokenized.shuffled"
# Shard names. The release numbers train shards 00001-00099 "of 00100" (there is no
# 00000) and held-out shards 00000-00049 of 00050.
LM1B_TRAIN_SHARD = re.compile(r"news\.en-(\d{5})-of-00100")
LM1B_HELDOUT_SHARD = re.compile(r"news\.en\.heldout-(\d{5})-of-00050")
LM1B_RELEASED_TRAIN_SHARDS = range(1, 100)
LM1B_RELEASED_HELDOUT_SHARDS = range(50)
# Which held-out shard is which split (see the module docstring for why).
LM1B_HELDOUT_SPLITS = {"valid": 1, "test": 0}

# How many names an error message lists before it says "and N more" (as corpora does).
_LISTED_NAMES = 5
# A --data value is a glob spec when it starts "word=".
_SPEC_START = re.compile(r"\s*[A-Za-z_]\w*\s*=")
# Items are cut at commas that start the next "split=", so a glob may hold a comma.
_SPEC_ITEM = re.compile(r",(?=\s*[A-Za-z_]\w*\s*=)")
_SPEC_EXAMPLE = "train=shards/train-*.txt,valid=shards/valid.txt,test=shards/test.txt"
_GLOB_CHARS = re.compile(r"[*?[]")


def parse_split_globs(text: str) -> dict[str, str] | None:
    """Reads a ``--data`` glob spec: ``train=GLOB,valid=GLOB,test=GLOB``.

    Items may come in any order; each split needs exactly one glob. A comma cuts an
    item only where the next ``split=`` starts, so ``train=a,b/*.txt`` is one glob.

    Args:
        text: The ``--data`` value.

    Returns:
        ``{"train": GLOB, "valid": GLOB, "test": GLOB}``, or None if ``text`` does not
        start with ``WORD=`` and so is not a spec (a folder, a file or a corpus name).

    Raises:
        DataError: If an item names an unknown split, gives a split twice or an empty
            glob, or a split has no glob.
    """
    if not _SPEC_START.match(text):
        return None
    globs: dict[str, str] = {}
    for item in _SPEC_ITEM.split(text):
        # Every item has an "=": the first by _SPEC_START, the others by _SPEC_ITEM.
        split, _, pattern = item.partition("=")
        split, pattern = split.strip(), pattern.strip()
        if split not in SPLITS:
            raise DataError(
                f"unknown split {split!r} in --data {text!r}; the splits are train, valid "
                f"and test, e.g. {_SPEC_EXAMPLE}")
        if split in globs:
            raise DataError(
                f"split {split!r} is given twice in --data {text!r}; give each of train, "
                "valid and test one glob")
        if not pattern:
            raise DataError(
                f"split {split!r} has an empty glob in --data {text!r}; give a glob of its "
                f"files, e.g. {_SPEC_EXAMPLE}")
        globs[split] = pattern
    missing = [split for split in SPLITS if split not in globs]
    if missing:
        raise DataError(
            f"--data {text!r} gives no glob for {' or '.join(missing)}; give each of train, "
            f"valid and test one glob, e.g. {_SPEC_EXAMPLE}")
    return {split: globs[split] for split in SPLITS}


def find_split_files(path: str | os.PathLike, *,
                     root: str | os.PathLike | None = None) -> dict[str, list[Path]]:
    """The files of each split of a corpus folder or a glob spec.

    Args:
        path: A folder in one of the layouts of the module docstring, or a glob spec
            ``train=GLOB,valid=GLOB,test=GLOB`` (see :func:`parse_split_globs`).
        root: The folder relative globs start from; None is the working directory.
            Unused for a folder.

    Returns:
        ``{"train": [...], "valid": [...], "test": [...]}`` in that order: each a sorted,
        non-empty list of files whose first bytes are UTF-8 text. A folder's files are
        under ``path`` as given (relative stays relative).

    Raises:
        DataError: If the path is missing or a file, no layout fits, a split folder or
            glob has no files, or a file is unreadable, binary or not UTF-8 (checked on
            its first bytes); the message names the path or glob and what would be right.
    """
    text = os.fspath(path)
    if not os.path.exists(text):
        globs = parse_split_globs(text)
        if globs is not None:
            return glob_split_files(globs, root=root)
    files = _folder_split_files(Path(path))
    return _checked(files)


def glob_split_files(globs: Mapping[str, str], *,
                     root: str | os.PathLike | None = None) -> dict[str, list[Path]]:
    """The files each split's glob matches (what :func:`find_split_files` does for a spec).

    Args:
        globs: One glob per split, e.g. from :func:`parse_split_globs`. ``~`` is expanded;
            ``**`` matches any depth of folders; hidden files match only a glob that
            names them (``.*``); folders are skipped.
        root: The folder relative globs start from; None is the working directory.

    Returns:
        As :func:`find_split_files`.

    Raises:
        DataError: If a glob matches no files, or a file is unreadable, binary or not UTF-8.
    """
    base = Path(os.getcwd() if root is None else root)
    files: dict[str, list[Path]] = {}
    for split in SPLITS:
        pattern = os.path.expanduser(globs[split])
        full = pattern if root is None or os.path.isabs(pattern) else os.path.join(root, pattern)
        matches = sorted(Path(p) for p in glob.glob(full, recursive=True) if os.path.isfile(p))
        if not matches:
            raise _no_glob_match(split, globs[split], pattern, base)
        files[split] = matches
    train = set(files["train"])
    for split in ("valid", "test"):
        shared = sorted(train.intersection(files[split]))
        if shared:
            logger.warning("%d %s file(s) are also train files (e.g. %s): %s perplexity is "
                           "measured on training text", len(shared), split, shared[0], split)
    return _checked(files)


def _no_glob_match(split: str, given: str, pattern: str, base: Path) -> DataError:
    # The folder the glob looked in: its part before the first wildcard.
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if _GLOB_CHARS.search(part)), len(parts) - 1)
    folder = Path(os.path.abspath(base / Path(*parts[:fixed]) if parts[:fixed] else base))
    where = f"{folder}, which does not exist" if not folder.is_dir() else str(folder)
    return DataError(
        f"{split} glob {given!r} matches no files in {where}; give a glob that matches the "
        f"{split} files (relative globs start from {base})")


def _folder_split_files(folder: Path) -> dict[str, list[Path]]:
    """Maps each split to its files, trying the layouts in the module docstring's order."""
    _check_folder(folder)
    try:
        flat = _flat_files(folder)
        if flat is not None:
            return flat
        if (folder / "train").is_dir():
            return _split_folders(folder)
        if (folder / LM1B_TRAIN_FOLDER).is_dir() or (folder / LM1B_HELDOUT_FOLDER).is_dir():
            return _lm1b_files(folder)
        if (folder / LM1B_RELEASE_FOLDER).is_dir():
            return _folder_split_files(folder / LM1B_RELEASE_FOLDER)
        accepted = ", ".join(p.format("{train,valid,test}") for p in SPLIT_PATTERNS)
        # "has no recognised split files; expected one of …, but it holds …" is the
        # message of corpora.read_text_dir, which tests and users already know.
        raise DataError(
            f"corpus folder {folder} holds no train/valid/test folders or lm1b shards and "
            f"has no recognised split files; expected one of {accepted}, but "
            f"{_listing(folder)}")
    except PermissionError as e:
        denied = Path(e.filename) if e.filename else folder
        raise DataError(
            f"cannot read corpus folder {denied}: permission denied; make it readable "
            f"(e.g. chmod a+rx {denied})") from None


def _check_folder(folder: Path) -> None:
    if folder.is_file():
        raise DataError(
            f"corpus path {folder} is a file, not a folder; pass the folder that holds the "
            f"train/valid/test files (e.g. {folder.parent})")
    if not folder.is_dir():
        if _GLOB_CHARS.search(str(folder)):
            raise DataError(
                f"corpus folder {folder} does not exist and looks like a glob; give one glob "
                f"per split instead, e.g. --data '{_SPEC_EXAMPLE}'")
        raise DataError(
            f"corpus folder {folder} does not exist; pass a folder that holds train/valid/test "
            "text files (see input/README.md)")


def _flat_files(folder: Path) -> dict[str, list[Path]] | None:
    """One file a split, named by the first of SPLIT_PATTERNS that has a train file.

    The rules and messages are those of ``corpora.read_text_dir``.
    """
    for pattern in SPLIT_PATTERNS:
        files = {split: folder / pattern.format(split) for split in SPLITS}
        if not files["train"].exists():
            continue
        for split in ("valid", "test"):
            if not files[split].exists():
                raise DataError(
                    f"corpus folder {folder} has {files['train'].name} but no "
                    f"{files[split].name}; put the {split} split beside it under that name")
        return {split: [file] for split, file in files.items()}
    return None


def _split_folders(folder: Path) -> dict[str, list[Path]]:
    """train/, valid/, test/: every regular, non-hidden file directly inside each."""
    files = {}
    for split in SPLITS:
        sub = folder / split
        if not sub.is_dir():
            raise DataError(
                f"corpus folder {folder} has train/ but no {split}/ folder; put the {split} "
                f"split's text files in {sub}/")
        found = sorted(p for p in sub.iterdir() if not p.name.startswith(".") and p.is_file())
        if not found:
            raise DataError(
                f"{split} folder {sub} holds no files ({_listing(sub, hidden=True)}); put "
                f"the {split} split's text files directly in it (hidden files and folders "
                "are skipped)")
        files[split] = found
    return files


def _lm1b_files(folder: Path) -> dict[str, list[Path]]:
    """lm1b's release: every train shard present; held-out shards 00001 and 00000."""
    train_dir, heldout_dir = folder / LM1B_TRAIN_FOLDER, folder / LM1B_HELDOUT_FOLDER
    again = f"download it again with: {command('tfpar-download', 'lm1b')}"
    for sub, other in ((train_dir, heldout_dir), (heldout_dir, train_dir)):
        if not sub.is_dir():
            raise DataError(
                f"lm1b folder {folder} has {other.name}/ but no {sub.name}/; it needs both "
                f"of the release's folders; {again}")
    train = sorted(p for p in train_dir.iterdir() if LM1B_TRAIN_SHARD.fullmatch(p.name)
                   and p.is_file())
    if not train:
        raise DataError(
            f"lm1b train folder {train_dir} holds no news.en-NNNNN-of-00100 shards "
            f"({_listing(train_dir)}); {again}")
    numbers = {int(LM1B_TRAIN_SHARD.fullmatch(p.name).group(1)) for p in train}
    missing = [n for n in LM1B_RELEASED_TRAIN_SHARDS if n not in numbers]
    if missing:
        # A subset is a legitimate smaller run, so it is a warning, not an error.
        logger.warning("lm1b train folder %s has %d of the %d released shards (missing: %s)",
                       train_dir, len(numbers & set(LM1B_RELEASED_TRAIN_SHARDS)),
                       len(LM1B_RELEASED_TRAIN_SHARDS), _shown(f"{n:05d}" for n in missing))
    files = {"train": train}
    for split, number in LM1B_HELDOUT_SPLITS.items():
        shard = heldout_dir / f"news.en.heldout-{number:05d}-of-00050"
        if not shard.is_file():
            raise DataError(
                f"lm1b held-out folder {heldout_dir} has no {shard.name}, which is the "
                f"{split} split ({_listing(heldout_dir)}); {again}")
        files[split] = [shard]
    return {split: files[split] for split in SPLITS}


def _checked(files: dict[str, list[Path]]) -> dict[str, list[Path]]:
    """Checks the first bytes of every file; returns ``files``."""
    for split, paths in files.items():
        for path in paths:
            check_text_prefix(path, split, holds=SENTENCE_PER_LINE)
    logger.info("Split files (train/valid/test): %s",
                "/".join(str(len(files[s])) for s in SPLITS))
    return files


def _shown(names) -> str:
    names = list(names)
    more = f" and {len(names) - _LISTED_NAMES} more" if len(names) > _LISTED_NAMES else ""
    return ", ".join(names[:_LISTED_NAMES]) + more


def _listing(folder: Path, *, hidden: bool = False) -> str:
    """Describes what a folder holds, naming the first few entries (folders end in /)."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                   if hidden or not p.name.startswith("."))
    return f"it holds {_shown(names)}" if names else "it is empty"
