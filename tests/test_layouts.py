"""Tests for tfpar.data.layouts: every layout of a --data folder, glob specs, lm1b, errors."""

import logging
import os
import re
from pathlib import Path

import pytest

from tfpar.data import corpora, layouts
from tfpar.data.textfile import PREFIX_BYTES
from tfpar.errors import DataError

SPLITS = ("train", "valid", "test")


def _write(path: Path, data: bytes | str = "a b\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


def _flat(folder: Path, pattern: str) -> dict[str, list[Path]]:
    return {split: [_write(folder / pattern.format(split))] for split in SPLITS}


def _lm1b(folder: Path, train=range(1, 100), heldout=range(50)) -> Path:
    for n in train:
        _write(folder / layouts.LM1B_TRAIN_FOLDER / f"news.en-{n:05d}-of-00100", f"t{n}\n")
    for n in heldout:
        _write(folder / layouts.LM1B_HELDOUT_FOLDER / f"news.en.heldout-{n:05d}-of-00050",
               f"h{n}\n")
    return folder


def _refuse_open(monkeypatch, refused: Path) -> None:
    """Makes opening ``refused`` fail as an unreadable file does (root reads anything)."""
    real = Path.open

    def refuse(self, *args, **kwargs):
        if self == refused:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)


# --- flat files: the rules and messages of corpora.read_text_dir -------------------------


@pytest.mark.parametrize("pattern", corpora.SPLIT_PATTERNS)
def test_flat_files_each_pattern(tmp_path, pattern):
    expected = _flat(tmp_path, pattern)
    found = layouts.find_split_files(tmp_path)
    assert found == expected and list(found) == list(SPLITS)


def test_flat_first_pattern_with_a_train_file_wins(tmp_path):
    _flat(tmp_path, "{}.txt")
    expected = _flat(tmp_path, "ptb.{}.txt")
    assert layouts.find_split_files(str(tmp_path)) == expected


def test_flat_files_win_over_split_folders(tmp_path):
    expected = _flat(tmp_path, "{}.txt")
    _write(tmp_path / "train" / "other.txt")
    assert layouts.find_split_files(tmp_path) == expected


@pytest.mark.parametrize("missing", ["valid", "test"])
def test_flat_missing_valid_or_test(tmp_path, missing):
    _flat(tmp_path, "wiki.{}.tokens")
    (tmp_path / f"wiki.{missing}.tokens").unlink()
    with pytest.raises(DataError, match=rf"has wiki\.train\.tokens but no wiki\.{missing}\.tokens; "
                                        rf"put the {missing} split beside it"):
        layouts.find_split_files(tmp_path)


def test_no_layout_lists_the_accepted_names_and_contents(tmp_path):
    for name in ["a.csv", "b.csv", "c.csv", "d.csv", "e.csv", "f.csv", "g.csv"]:
        _write(tmp_path / name)
    # The part after "holds … shards and" is corpora.read_text_dir's message, unchanged.
    expected = (f"corpus folder {tmp_path} holds no train/valid/test folders or lm1b shards "
                "and has no recognised split files; expected one of ptb.{train,valid,test}.txt, "
                "wiki.{train,valid,test}.tokens, {train,valid,test}.txt, but it holds "
                "a.csv, b.csv, c.csv, d.csv, e.csv and 2 more")
    with pytest.raises(DataError, match=f"^{re.escape(expected)}$"):
        layouts.find_split_files(tmp_path)


def test_no_layout_in_an_empty_folder(tmp_path):
    with pytest.raises(DataError, match=r"no recognised split files; .* but it is empty$"):
        layouts.find_split_files(tmp_path)


def test_missing_folder(tmp_path):
    with pytest.raises(DataError, match=r"corpus folder .*nope does not exist; pass a folder"):
        layouts.find_split_files(tmp_path / "nope")


def test_missing_folder_that_looks_like_a_glob(tmp_path):
    with pytest.raises(DataError, match=r"corpus folder .*shards/\*\.txt does not exist and looks "
                                        r"like a glob; give one glob per split instead, e\.g\. "
                                        r"--data 'train=shards/train-\*\.txt,"):
        layouts.find_split_files(tmp_path / "shards" / "*.txt")


def test_path_is_a_file(tmp_path):
    file = _write(tmp_path / "train.txt")
    with pytest.raises(DataError, match=r"corpus path .*train\.txt is a file, not a folder"):
        layouts.find_split_files(file)


def test_unlistable_folder(tmp_path, monkeypatch):
    _write(tmp_path / "notes.md")
    real = Path.iterdir

    def refuse(self):
        if self == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", refuse)
    with pytest.raises(DataError, match=rf"^cannot read corpus folder {re.escape(str(tmp_path))}: "
                                        r"permission denied; make it readable "
                                        r"\(e\.g\. chmod a\+rx"):
        layouts.find_split_files(tmp_path)


# --- split folders ------------------------------------------------------------------------


def test_split_folders_sorted_skipping_hidden_files_and_subfolders(tmp_path):
    for split in SPLITS:
        for name in ("b.txt", "a.txt", "10.txt", ".hidden"):
            _write(tmp_path / split / name)
        _write(tmp_path / split / "sub" / "deeper.txt")
    found = layouts.find_split_files(tmp_path)
    assert found == {split: [tmp_path / split / n for n in ("10.txt", "a.txt", "b.txt")]
                     for split in SPLITS}


@pytest.mark.parametrize("missing", ["valid", "test"])
def test_split_folder_missing(tmp_path, missing):
    for split in SPLITS:
        if split != missing:
            _write(tmp_path / split / "part-0")
    with pytest.raises(DataError, match=rf"^corpus folder {re.escape(str(tmp_path))} has train/ "
                                        rf"but no {missing}/ folder; put the {missing} split's "
                                        rf"text files in .*{missing}/$"):
        layouts.find_split_files(tmp_path)


def test_split_folder_with_no_files(tmp_path):
    _write(tmp_path / "train" / "part-0")
    _write(tmp_path / "test" / "part-0")
    _write(tmp_path / "valid" / ".DS_Store")
    (tmp_path / "valid" / "old").mkdir()
    valid = tmp_path / "valid"
    with pytest.raises(DataError, match=rf"^valid folder {re.escape(str(valid))} holds no files "
                                        r"\(it holds \.DS_Store, old/\); put the valid split's "
                                        r"text files directly in it \(hidden files and folders "
                                        r"are skipped\)$"):
        layouts.find_split_files(tmp_path)


def test_empty_split_folder(tmp_path):
    for split in SPLITS:
        (tmp_path / split).mkdir()
    with pytest.raises(DataError, match=r"^train folder .*train holds no files \(it is empty\)"):
        layouts.find_split_files(tmp_path)


# --- glob specs ---------------------------------------------------------------------------


def test_parse_split_globs_any_order_and_commas_inside_a_glob():
    assert layouts.parse_split_globs("test=t.txt, valid = v/*.txt,train=a,b/*.txt") == {
        "train": "a,b/*.txt", "valid": "v/*.txt", "test": "t.txt"}


@pytest.mark.parametrize("text", ["synthetic", "ptb", "input/ptb", "tfds:lm1b", "/a=b/c", ""])
def test_parse_split_globs_ignores_other_sources(text):
    assert layouts.parse_split_globs(text) is None


@pytest.mark.parametrize("text, message", [
    ("dev=d/*,train=a/*,test=t", r"^unknown split 'dev' in --data 'dev=d/\*,train=a/\*,test=t'; "
                                 r"the splits are train, valid and test, e\.g\. train="),
    ("train=a/*,train=b/*,valid=v,test=t", r"^split 'train' is given twice in --data "
                                           r"'train=a/\*,train=b/\*,valid=v,test=t'; give each"),
    ("train=,valid=v,test=t", r"^split 'train' has an empty glob in --data 'train=,valid=v,"
                              r"test=t'; give a glob of its files"),
    ("train=a/*", r"^--data 'train=a/\*' gives no glob for valid or test; give each of train, "
                  r"valid and test one glob, e\.g\. train=shards/train-\*\.txt,"),
])
def test_parse_split_globs_errors(text, message):
    with pytest.raises(DataError, match=message):
        layouts.parse_split_globs(text)


def test_globs_relative_to_the_working_directory(tmp_path, monkeypatch):
    for n in (2, 0, 1):
        _write(tmp_path / "shards" / f"train-{n}.txt")
    _write(tmp_path / "shards" / "valid.txt")
    _write(tmp_path / "held" / "test.txt")
    (tmp_path / "shards" / "train-dir.txt").mkdir()  # a folder the glob matches is skipped
    monkeypatch.chdir(tmp_path)
    found = layouts.find_split_files(
        "train=shards/train-*.txt,valid=shards/valid.txt,test=held/*.txt")
    assert found == {"train": [Path(f"shards/train-{n}.txt") for n in range(3)],
                     "valid": [Path("shards/valid.txt")], "test": [Path("held/test.txt")]}


def test_globs_relative_to_root_absolute_and_recursive(tmp_path):
    _write(tmp_path / "c" / "x" / "y" / "a.txt")
    _write(tmp_path / "c" / "b.txt")
    _write(tmp_path / "v.txt")
    spec = f"train=c/**/*.txt,valid=v.txt,test={tmp_path / 'v.txt'}"
    found = layouts.find_split_files(spec, root=tmp_path)
    assert found == {"train": [tmp_path / "c" / "b.txt", tmp_path / "c" / "x" / "y" / "a.txt"],
                     "valid": [tmp_path / "v.txt"], "test": [tmp_path / "v.txt"]}


def test_glob_matching_nothing_names_the_glob_and_folder(tmp_path):
    _write(tmp_path / "shards" / "train-0.txt")
    _write(tmp_path / "shards" / "test.txt")
    spec = "train=shards/train-*.txt,valid=shards/valid-*.txt,test=shards/test.txt"
    with pytest.raises(DataError, match=rf"^valid glob 'shards/valid-\*\.txt' matches no files in "
                                        rf"{re.escape(str(tmp_path / 'shards'))}; give a glob "
                                        r"that matches the valid files \(relative globs start "
                                        rf"from {re.escape(str(tmp_path))}\)$"):
        layouts.find_split_files(spec, root=tmp_path)


def test_glob_in_a_missing_folder(tmp_path):
    spec = "train=nope/*.txt,valid=v,test=t"
    with pytest.raises(DataError, match=rf"^train glob 'nope/\*\.txt' matches no files in "
                                        rf"{re.escape(str(tmp_path / 'nope'))}, which does not "
                                        "exist; give a glob"):
        layouts.find_split_files(spec, root=tmp_path)


def test_glob_overlap_with_train_is_a_warning(tmp_path, caplog):
    _write(tmp_path / "all.txt")
    with caplog.at_level(logging.WARNING, logger="tfpar.data.layouts"):
        found = layouts.find_split_files("train=*.txt,valid=all.txt,test=all.txt", root=tmp_path)
    assert found["valid"] == found["train"] == [tmp_path / "all.txt"]
    assert "1 valid file(s) are also train files" in caplog.text
    assert "1 test file(s) are also train files" in caplog.text


# --- lm1b ---------------------------------------------------------------------------------


def _lm1b_expected(folder: Path, train=range(1, 100)) -> dict[str, list[Path]]:
    heldout = folder / layouts.LM1B_HELDOUT_FOLDER
    return {
        "train": [folder / layouts.LM1B_TRAIN_FOLDER / f"news.en-{n:05d}-of-00100" for n in train],
        "valid": [heldout / "news.en.heldout-00001-of-00050"],
        "test": [heldout / "news.en.heldout-00000-of-00050"]}


def test_lm1b_release_folder(tmp_path, caplog):
    folder = _lm1b(tmp_path / layouts.LM1B_RELEASE_FOLDER)
    _write(folder / "README")  # not a shard, not a layout
    with caplog.at_level(logging.WARNING):
        found = layouts.find_split_files(folder)
    assert found == _lm1b_expected(folder)
    assert len(found["train"]) == 99 and caplog.text == ""


def test_lm1b_parent_of_the_release_folder(tmp_path):
    folder = _lm1b(tmp_path / layouts.LM1B_RELEASE_FOLDER)
    assert layouts.find_split_files(tmp_path) == _lm1b_expected(folder)


def test_lm1b_some_train_shards_is_a_warning(tmp_path, caplog):
    _lm1b(tmp_path, train=(3, 1, 2), heldout=(0, 1))
    _write(tmp_path / layouts.LM1B_TRAIN_FOLDER / ".news.en-00004-of-00100.part")
    with caplog.at_level(logging.WARNING, logger="tfpar.data.layouts"):
        found = layouts.find_split_files(tmp_path)
    assert found == _lm1b_expected(tmp_path, train=(1, 2, 3))
    assert (f"lm1b train folder {tmp_path / layouts.LM1B_TRAIN_FOLDER} has 3 of the 99 released "
            "shards (missing: 00004, 00005, 00006, 00007, 00008 and 91 more)") in caplog.text


def test_lm1b_no_train_shards(tmp_path):
    _lm1b(tmp_path, train=())
    _write(tmp_path / layouts.LM1B_TRAIN_FOLDER / "news.en-1-of-100")
    train_dir = tmp_path / layouts.LM1B_TRAIN_FOLDER
    with pytest.raises(DataError, match=rf"^lm1b train folder {re.escape(str(train_dir))} holds no "
                                        r"news\.en-NNNNN-of-00100 shards \(it holds "
                                        r"news\.en-1-of-100\); download it again with: "
                                        r"tfpar-download lm1b \(from a clone: python "
                                        r"scripts/download_data\.py lm1b\)$"):
        layouts.find_split_files(tmp_path)


@pytest.mark.parametrize("split, number", [("valid", 1), ("test", 0)])
def test_lm1b_missing_heldout_shard(tmp_path, split, number):
    _lm1b(tmp_path, train=(1,), heldout=[n for n in range(3) if n != number])
    heldout = tmp_path / layouts.LM1B_HELDOUT_FOLDER
    with pytest.raises(DataError, match=rf"^lm1b held-out folder {re.escape(str(heldout))} has no "
                                        rf"news\.en\.heldout-{number:05d}-of-00050, which is the "
                                        rf"{split} split \(it holds .*\); download it again"):
        layouts.find_split_files(tmp_path)


def test_lm1b_missing_heldout_folder(tmp_path):
    _lm1b(tmp_path, train=(1,), heldout=())
    with pytest.raises(DataError, match=rf"^lm1b folder {re.escape(str(tmp_path))} has "
                                        r"training-monolingual\.tokenized\.shuffled/ but no "
                                        r"heldout-monolingual\.tokenized\.shuffled/; it needs "
                                        r"both"):
        layouts.find_split_files(tmp_path)


# --- every file's first bytes -------------------------------------------------------------


def test_unreadable_shard(tmp_path, monkeypatch):
    _lm1b(tmp_path, train=(1, 2), heldout=(0, 1))
    shard = tmp_path / layouts.LM1B_TRAIN_FOLDER / "news.en-00002-of-00100"
    shard.chmod(0)
    if os.access(shard, os.R_OK):
        _refuse_open(monkeypatch, shard)
    with pytest.raises(DataError, match=rf"^cannot read train file {re.escape(str(shard))}: "
                                        r"permission denied; make it readable \(e\.g\. chmod a\+r"):
        layouts.find_split_files(tmp_path)


def test_binary_shard(tmp_path):
    _write(tmp_path / "train" / "a.txt")
    _write(tmp_path / "valid" / "a.txt")
    shard = _write(tmp_path / "test" / "b.bin", b"text\n\x00\x01")
    with pytest.raises(DataError, match=rf"^test file {re.escape(str(shard))} is binary, not text "
                                        r"\(NUL byte at offset 5\); it must be UTF-8 text with one "
                                        r"sentence per line$"):
        layouts.find_split_files(tmp_path)


def test_not_utf8_shard(tmp_path):
    shard = _write(tmp_path / "v" / "latin1.txt", "café\n".encode("latin-1"))
    _write(tmp_path / "t.txt")
    with pytest.raises(DataError, match=rf"^valid file {re.escape(str(shard))} is not UTF-8: byte "
                                        r"0xe9 at offset 3 cannot be decoded; re-encode the file"):
        layouts.find_split_files("train=t.txt,valid=v/*,test=t.txt", root=tmp_path)


def test_only_a_prefix_is_checked(tmp_path):
    # A NUL past the prefix is left to the pipeline; a character cut by the prefix's end
    # is not mistaken for bad UTF-8; a byte-order mark is fine.
    ascii_then_nul = b"a" * PREFIX_BYTES + b"\x00"
    cut = "\ufeff".encode() + b"b" * (PREFIX_BYTES - 4) + "€".encode() + b"\n"  # € is 3 bytes
    assert len(cut[:PREFIX_BYTES]) == PREFIX_BYTES and cut[PREFIX_BYTES - 1] == 0xE2
    _write(tmp_path / "train.txt", ascii_then_nul)
    _write(tmp_path / "valid.txt", cut)
    _write(tmp_path / "test.txt", "")
    assert layouts.find_split_files(tmp_path)["valid"] == [tmp_path / "valid.txt"]


def test_bad_byte_inside_the_prefix_after_a_cut_character_is_caught(tmp_path):
    data = b"c" * (PREFIX_BYTES - 2) + b"\xff\xe2\x82"  # 0xff is never UTF-8
    _write(tmp_path / "train.txt", data)
    _write(tmp_path / "valid.txt")
    _write(tmp_path / "test.txt")
    with pytest.raises(DataError, match=rf"is not UTF-8: byte 0xff at offset {PREFIX_BYTES - 2} "):
        layouts.find_split_files(tmp_path)
