"""Tests for tfpar.data.corpora: corpus folders, named corpora, TFDS and every error message."""

import os
import re
from pathlib import Path

import pytest

from tfpar.data import corpora
from tfpar.data.text import TextSplit
from tfpar.errors import DataError

SHARED_DATA = Path(os.environ.get(
    "TFPAR_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def _shared(name: str) -> Path:
    folder = SHARED_DATA / name
    if not folder.is_dir():
        pytest.skip(f"shared corpus folder {folder} is absent (set TFPAR_SHARED_DATA to the "
                    "folder that holds ptb/ and wikitext-2/)")
    return folder


def _write_corpus(folder: Path, pattern: str, texts: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    texts = texts or {"train": " a b c \n d e\n", "valid": "a\n", "test": "b c\n"}
    for split, text in texts.items():
        (folder / pattern.format(split)).write_text(text, encoding="utf-8")
    return folder


# --- read_text_dir: formats -------------------------------------------------------------


@pytest.mark.parametrize("pattern", corpora.SPLIT_PATTERNS)
def test_read_text_dir_recognises_each_pattern(tmp_path, pattern):
    corpus = corpora.read_text_dir(_write_corpus(tmp_path / "mine", pattern))
    assert corpus.name == "mine"
    assert [corpus.lines(s) for s in corpora.SPLITS] == [["a b c", "d e"], ["a"], ["b c"]]


def test_first_pattern_with_a_train_file_wins(tmp_path):
    _write_corpus(tmp_path, "{}.txt", {"train": "plain\n", "valid": "v\n", "test": "t\n"})
    _write_corpus(tmp_path, "ptb.{}.txt", {"train": "ptb\n", "valid": "v\n", "test": "t\n"})
    assert corpora.read_text_dir(tmp_path).lines("train") == ["ptb"]


def test_blank_lines_skipped_and_lines_stripped(tmp_path):
    text = "\n  \n\tone two \r\n\n three\n \t \nfour"  # CRLF, tabs, no final newline
    _write_corpus(tmp_path, "{}.txt", {"train": text, "valid": "v\n", "test": "t\n"})
    assert corpora.read_text_dir(tmp_path).lines("train") == ["one two", "three", "four"]


def test_utf8_and_byte_order_mark(tmp_path):
    _write_corpus(tmp_path, "{}.txt", {"train": "\ufeffcafé naïve\n", "valid": "ü\n",
                                       "test": "t\n"})
    corpus = corpora.read_text_dir(tmp_path)
    assert corpus.lines("train") == ["café naïve"]
    assert corpus.lines("valid") == ["ü"]


def test_repr_does_not_print_sentences():
    split = TextSplit.of_files([])
    assert repr(corpora.Corpus("x", split, split, split)) == "Corpus(name='x')"


# --- read_text_dir: errors --------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(DataError, match=r"corpus folder .*nope does not exist; pass a folder"):
        corpora.read_text_dir(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    file = tmp_path / "train.txt"
    file.write_text("a\n")
    with pytest.raises(DataError, match=r"corpus path .*train\.txt is a file, not a folder"):
        corpora.read_text_dir(file)


def test_no_recognised_split_names_lists_patterns_and_contents(tmp_path):
    for name in ["a.csv", "b.csv", "c.csv", "d.csv", "e.csv", "f.csv", "g.csv"]:
        (tmp_path / name).write_text("x\n")
    expected = ("has no recognised split files; expected one of ptb.{train,valid,test}.txt, "
                "wiki.{train,valid,test}.tokens, {train,valid,test}.txt, but it holds "
                "a.csv, b.csv, c.csv, d.csv, e.csv and 2 more")
    with pytest.raises(DataError, match=re.escape(expected)):
        corpora.read_text_dir(tmp_path)


def test_no_recognised_split_names_in_empty_folder(tmp_path):
    with pytest.raises(DataError, match=r"no recognised split files; .* but it is empty$"):
        corpora.read_text_dir(tmp_path)


@pytest.mark.parametrize("missing", ["valid", "test"])
def test_missing_valid_or_test(tmp_path, missing):
    _write_corpus(tmp_path, "wiki.{}.tokens")
    (tmp_path / f"wiki.{missing}.tokens").unlink()
    (tmp_path / f"{missing}.txt").write_text("other pattern does not count\n")
    with pytest.raises(DataError, match=rf"has wiki\.train\.tokens but no wiki\.{missing}\.tokens; "
                                        rf"put the {missing} split beside it"):
        corpora.read_text_dir(tmp_path)


def test_unreadable_file(tmp_path, monkeypatch):
    _write_corpus(tmp_path, "{}.txt")
    valid = tmp_path / "valid.txt"
    valid.chmod(0)
    if os.access(valid, os.R_OK):  # root reads anything, so fake the refusal
        real = Path.read_bytes

        def refuse(self):
            if self == valid:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(DataError, match=r"cannot read valid file .*valid\.txt: permission denied; "
                                        r"make it readable"):
        corpora.read_text_dir(tmp_path)


def test_split_file_is_a_folder(tmp_path):
    _write_corpus(tmp_path, "{}.txt")
    (tmp_path / "test.txt").unlink()
    (tmp_path / "test.txt").mkdir()
    with pytest.raises(DataError, match=r"test file .*test\.txt is a folder; it must be a UTF-8"):
        corpora.read_text_dir(tmp_path)


def test_not_utf8_names_file_and_offset(tmp_path):
    _write_corpus(tmp_path, "{}.txt")
    (tmp_path / "train.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"train file .*train\.txt is not UTF-8: byte 0xe9 at "
                                        r"offset 3 cannot be decoded; re-encode"):
        corpora.read_text_dir(tmp_path)


def test_binary_file_names_nul_offset(tmp_path):
    _write_corpus(tmp_path, "{}.txt")
    (tmp_path / "valid.txt").write_bytes(b"PK\x03\x04\x00\x00zip")
    with pytest.raises(DataError, match=r"valid file .*valid\.txt is binary, not text \(NUL byte "
                                        r"at offset 4\)"):
        corpora.read_text_dir(tmp_path)


@pytest.mark.parametrize("text", ["", "\n \n\t\n"])
def test_empty_split(tmp_path, text):
    _write_corpus(tmp_path, "ptb.{}.txt", {"train": "a\n", "valid": "b\n", "test": text})
    with pytest.raises(DataError, match=r"test split .*ptb\.test\.txt has no sentences \(it is "
                                        r"empty or holds only blank lines\)"):
        corpora.read_text_dir(tmp_path)


# --- resolve_named and load_text_corpus ---------------------------------------------------


@pytest.mark.parametrize("name, folder, pattern", [
    ("ptb", "ptb", "ptb.{}.txt"),
    ("wikitext-2", "wikitext-2", "wiki.{}.tokens"),
    ("wikitext2", "wikitext-2", "wiki.{}.tokens"),
])
def test_resolve_named_finds_input_subfolder(tmp_path, name, folder, pattern):
    _write_corpus(tmp_path / folder, pattern)
    corpus = corpora.resolve_named(name, input_dir=tmp_path)
    assert corpus.name == folder
    assert corpus.lines("test") == ["b c"]


def test_resolve_named_missing_says_how_to_download(tmp_path):
    expected = (f"corpus 'wikitext-2' is missing: {tmp_path / 'wikitext-2'} does not exist; "
                f"download it with: tfpar-download wikitext-2 --input-dir {tmp_path} (from "
                f"a clone: python scripts/download_data.py wikitext-2 --input-dir {tmp_path}), "
                "or pass --data DIR")
    with pytest.raises(DataError, match=re.escape(expected)):
        corpora.resolve_named("wikitext2", input_dir=tmp_path)


def test_lm1b_missing_says_how_to_download(tmp_path):
    expected = (f"corpus 'lm1b' is missing: {tmp_path / 'lm1b'} does not exist; download it "
                f"with: tfpar-download lm1b --input-dir {tmp_path} (from a clone: python "
                f"scripts/download_data.py lm1b --input-dir {tmp_path}), or pass --data DIR")
    with pytest.raises(DataError, match=re.escape(expected)):
        corpora.load_text_corpus("lm1b", input_dir=tmp_path)


def test_resolve_named_default_input_dir_gives_plain_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"download it with: tfpar-download ptb \(from a clone: "
                                        r"python scripts/download_data\.py ptb\), or pass "
                                        r"--data DIR$"):
        corpora.resolve_named("ptb")


def test_resolve_named_unknown_name():
    with pytest.raises(DataError, match=r"unknown corpus name 'ptb2'; expected one of: ptb, "
                                        r"wikitext-2, wikitext2"):
        corpora.resolve_named("ptb2")


def test_load_text_corpus_dispatches_names_and_folders(tmp_path, monkeypatch):
    _write_corpus(tmp_path / "input" / "ptb", "ptb.{}.txt")
    _write_corpus(tmp_path / "elsewhere", "{}.txt")
    assert corpora.load_text_corpus("ptb", input_dir=tmp_path / "input").name == "ptb"
    assert corpora.load_text_corpus(str(tmp_path / "elsewhere")).name == "elsewhere"
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert corpora.load_text_corpus(".").name == "elsewhere"


def test_load_text_corpus_dispatches_tfds(monkeypatch):
    calls = []
    monkeypatch.setattr(corpora, "load_tfds", lambda name, *, data_dir: calls.append(
        (name, data_dir)) or "corpus")
    assert corpora.load_text_corpus("tfds:lm1b", tfds_data_dir="/d") == "corpus"
    assert calls == [("lm1b", "/d")]


def test_load_text_corpus_unknown_source(tmp_path):
    with pytest.raises(DataError, match=r"data source 'no_such_corpus' is not a known corpus "
                                        r"\(ptb, wikitext-2, wikitext2\), not tfds:NAME and not "
                                        r"an existing folder"):
        corpora.load_text_corpus("no_such_corpus", input_dir=tmp_path)


def test_load_text_corpus_tfds_without_name():
    with pytest.raises(DataError,
                       match=r"data source 'tfds:' names no TFDS dataset; use tfds:NAME"):
        corpora.load_text_corpus("tfds:")


def test_known_corpora_table_matches_patterns():
    for name, known in corpora.KNOWN_CORPORA.items():
        assert known.name == name
        assert [f.split for f in known.files] == list(corpora.SPLITS)
        assert all(re.fullmatch(r"[0-9a-f]{64}", f.sha256) for f in known.files)


# --- the real corpora ------------------------------------------------------------------


def test_real_ptb():
    corpus = corpora.load_text_corpus("ptb", input_dir=_shared("ptb").parent)
    # The shared README's line counts; PTB has no blank lines.
    assert (len(corpus.lines("train")), len(corpus.lines("valid")), len(corpus.lines("test"))) == (42068, 3370, 3761)
    assert sum(len(s.split()) for s in corpus.lines("train")) == 887521
    assert corpus.lines("train")[0].split()[0] == "aer"


def test_real_wikitext2():
    corpus = corpora.resolve_named("wikitext2", input_dir=_shared("wikitext-2").parent)
    # The shared README's lines minus its empty ones: 36,718 - 12,951 and so on.
    assert (len(corpus.lines("train")), len(corpus.lines("valid")), len(corpus.lines("test"))) == (
        36718 - 12951, 3760 - 1299, 4358 - 1467)
    assert sum(len(s.split()) for s in corpus.lines("train")) == 2051910
    assert corpus.lines("train")[0] == "= Valkyria Chronicles III ="


# --- TFDS (never touches the network) ----------------------------------------------------


@pytest.fixture(scope="module")
def tfds():
    return pytest.importorskip("tensorflow_datasets")


def test_tfds_mock_gives_text_sentences(tfds, tmp_path):
    with tfds.testing.mock_data(num_examples=5):
        corpus = corpora.load_tfds("tiny_shakespeare", data_dir=str(tmp_path))
    assert corpus.name == "tfds:tiny_shakespeare"
    for split in (corpus.lines("train"), corpus.lines("valid"), corpus.lines("test")):
        assert 1 <= len(split) <= 5
        assert all(isinstance(s, str) and s == s.strip() and s for s in split)


def test_tfds_splits_each_example_on_newlines(tfds, tmp_path):
    import tensorflow as tf

    texts = {"train": ["First Citizen:\nBefore we proceed\n\n  any further, hear me speak.\n",
                       "All:\nSpeak, speak."],
             "validation": ["one\n\n"], "test": ["\ntwo  words\n"]}

    def as_dataset(self, split, **kwargs):
        return tf.data.Dataset.from_tensor_slices({"text": texts[split]})

    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        corpus = corpora.load_tfds("tiny_shakespeare", data_dir=str(tmp_path))
    assert corpus.lines("train") == ["First Citizen:", "Before we proceed", "any further, hear me speak.",
                            "All:", "Speak, speak."]
    assert corpus.lines("valid") == ["one"]
    assert corpus.lines("test") == ["two  words"]


def test_tfds_not_prepared_says_how_to_prepare(tfds, tmp_path):
    expected = (f"TFDS dataset 'tiny_shakespeare' is not prepared in {tmp_path} and tfpar does "
                "not download during training; prepare it online first with: python -c "
                "\"import tensorflow_datasets as tfds; tfds.load('tiny_shakespeare', "
                f"data_dir='{tmp_path}')\"")
    with pytest.raises(DataError, match=re.escape(expected) + "$"):
        corpora.load_tfds("tiny_shakespeare", data_dir=str(tmp_path))
    assert not any(tmp_path.rglob("*.tfrecord*"))  # nothing was downloaded


def test_tfds_unknown_dataset(tfds, tmp_path):
    with pytest.raises(DataError, match=r"^unknown TFDS dataset 'no_such_dataset_xyz'; pass "
                                        r"tfds:NAME with a text dataset"):
        corpora.load_tfds("no_such_dataset_xyz", data_dir=str(tmp_path))


def test_tfds_malformed_name(tfds, tmp_path):
    with pytest.raises(DataError, match=r"^TFDS dataset 'bad name!' cannot be built: .*; "
                                        r"expected NAME\[/CONFIG\]\[:VERSION\]"):
        corpora.load_tfds("bad name!", data_dir=str(tmp_path))


def test_tfds_without_text_feature(tfds, tmp_path):
    with pytest.raises(DataError, match=r"TFDS dataset 'mnist' has no 'text' feature \(it has: "
                                        r"image, label\)"):
        corpora.load_tfds("mnist", data_dir=str(tmp_path))


@pytest.fixture(scope="module")
def prepared_tfds_dir(tfds, tmp_path_factory):
    """A real TFDS text dataset with train and test but no validation, prepared offline."""

    class TfparTinyText(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(["a b\n\nc"]),
                    "test": self._generate_examples(["d"])}

        def _generate_examples(self, texts):
            for i, text in enumerate(texts):
                yield i, {"text": text}

    data_dir = tmp_path_factory.mktemp("tfds")
    TfparTinyText(data_dir=str(data_dir)).download_and_prepare()
    return data_dir


def test_tfds_missing_split_names_the_existing_ones(prepared_tfds_dir):
    with pytest.raises(DataError, match=r"TFDS dataset 'tfpar_tiny_text' has no 'validation' or "
                                        r"'valid' or 'dev' split; it has: train, test"):
        corpora.load_tfds("tfpar_tiny_text", data_dir=str(prepared_tfds_dir))


# --- read_text_file: one file cut into train, valid, test --------------------------------


def _write_lines(path: Path, n: int, blank_every: int = 0) -> Path:
    lines = []
    for i in range(n):
        lines.append(f"line {i}")
        if blank_every and i % blank_every == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("n,fractions,counts", [
    (100, (0.9, 0.05, 0.05), (90, 5, 5)),
    (101, (0.9, 0.05, 0.05), (91, 5, 5)),
    (10, (0.8, 0.1, 0.1), (8, 1, 1)),
    (7, (0.5, 0.25, 0.25), (4, 1, 2)),  # 3.5 -> 4, 5.25 -> 5: cumulative rounding
    (3, (1 / 3, 1 / 3, 1 / 3), (1, 1, 1)),
])
def test_one_file_is_cut_into_contiguous_blocks_with_exact_counts(tmp_path, n, fractions,
                                                                  counts):
    file = _write_lines(tmp_path / "all.txt", n)
    corpus = corpora.read_text_file(file, fractions)
    assert (len(corpus.lines("train")), len(corpus.lines("valid")), len(corpus.lines("test"))) == counts
    assert corpus.lines("train") + corpus.lines("valid") + corpus.lines("test") == [f"line {i}" for i in range(n)]
    assert corpus.name == "all.txt"


def test_one_file_split_is_deterministic_and_counts_non_blank_lines(tmp_path, caplog):
    file = _write_lines(tmp_path / "all.txt", 40, blank_every=3)
    with caplog.at_level("INFO", logger="tfpar.data.corpora"):
        first = corpora.read_text_file(file, (0.5, 0.25, 0.25))
        second = corpora.read_text_file(file, (0.5, 0.25, 0.25))
    assert (first.lines("train"), first.lines("valid"), first.lines("test")) == (second.lines("train"), second.lines("valid"), second.lines("test"))
    assert first.lines("valid")[0] == "line 20" and first.lines("test")[-1] == "line 39"
    assert [r.getMessage() for r in caplog.records] == 2 * [
        f"Split corpus file {file} by fractions 0.5,0.25,0.25: 20/10/10 lines (train/valid/test)"]


def test_load_text_corpus_takes_a_file_with_its_fractions(tmp_path):
    file = _write_lines(tmp_path / "all.txt", 20)
    corpus = corpora.load_text_corpus(str(file), split_fractions=(0.5, 0.3, 0.2))
    assert (len(corpus.lines("train")), len(corpus.lines("valid")), len(corpus.lines("test"))) == (10, 6, 4)
    assert len(corpora.load_text_corpus(str(file)).lines("test")) == 1  # default 0.9, 0.05, 0.05


@pytest.mark.parametrize("fractions,message", [
    ((0.9, 0.1, 0.1), r"split-fractions '0.9,0.1,0.1' sum to 1.1, not 1; give three fractions "
                      r"that sum to 1, e.g. 0.9,0.05,0.05"),
    ((0.8, 0.1, 0.0999), r"split-fractions '0.8,0.1,0.0999' sum to 0.9999, not 1"),
    ((1.0, 0.0, 0.0), r"split-fractions '1,0,0': the valid fraction must be > 0, got 0; "
                      r"every split needs lines"),
    ((1.2, -0.1, -0.1), r"split-fractions '1.2,-0.1,-0.1': the valid fraction must be > 0, "
                        r"got -0.1"),
    ((0.5, 0.5), r"split-fractions '0.5,0.5' must be three numbers train,valid,test"),
])
def test_bad_split_fractions(tmp_path, fractions, message):
    from tfpar.config import DataConfig
    from tfpar.errors import ConfigError

    file = _write_lines(tmp_path / "all.txt", 100)
    with pytest.raises(ConfigError, match=message):
        corpora.read_text_file(file, fractions)
    with pytest.raises(ConfigError, match=message):
        DataConfig(source=str(file), split_fractions=fractions)


def test_split_fractions_within_1e_6_of_one_are_accepted(tmp_path):
    file = _write_lines(tmp_path / "all.txt", 100)
    corpus = corpora.read_text_file(file, (0.9, 0.05, 0.0500009))
    assert (len(corpus.lines("train")), len(corpus.lines("valid")), len(corpus.lines("test"))) == (90, 5, 5)


@pytest.mark.parametrize("n,fractions,counts,needed", [
    (15, (0.9, 0.05, 0.05), "14/0/1", 16),
    (2, (0.5, 0.25, 0.25), "1/1/0", 4),
    (0, (0.9, 0.05, 0.05), "0/0/0", 16),
])
def test_a_file_too_short_for_every_split(tmp_path, n, fractions, counts, needed):
    file = _write_lines(tmp_path / "short.txt", n) if n else tmp_path / "short.txt"
    if not n:
        file.write_text("\n \n")
    shown = ",".join(f"{f:g}" for f in fractions)
    with pytest.raises(DataError, match=re.escape(
            f"corpus file {file} has {n} non-blank lines, too few to cut by --split-fractions "
            f"{shown} (train/valid/test would get {counts} lines); it needs at least {needed} "
            "lines, or give larger valid/test fractions")):
        corpora.read_text_file(file, fractions)
    if n:  # the advice is right: `needed` lines are enough
        corpus = corpora.read_text_file(_write_lines(tmp_path / "enough.txt", needed), fractions)
        assert min(len(corpus.lines("train")), len(corpus.lines("valid")), len(corpus.lines("test"))) == 1


def test_a_binary_or_non_utf8_file(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"line one\nab\0cd\n")
    with pytest.raises(DataError, match=r"corpus file .*model\.bin is binary, not text \(NUL "
                                        r"byte at offset 11\); it must be UTF-8 text"):
        corpora.read_text_file(binary)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"corpus file .*latin1\.txt is not UTF-8: byte 0xe9 at "
                                        r"offset 3 cannot be decoded; re-encode the file"):
        corpora.load_text_corpus(str(latin1))


def test_an_unreadable_file(tmp_path, monkeypatch):
    file = _write_lines(tmp_path / "all.txt", 100)
    file.chmod(0)
    if os.access(file, os.R_OK):  # root reads anything, so fake the refusal
        real = Path.read_bytes

        def refuse(self):
            if self == file:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(DataError, match=r"cannot read corpus file .*all\.txt: permission "
                                        r"denied; make it readable"):
        corpora.load_text_corpus(str(file))


def test_tfds_data_without_tensorflow_datasets_is_a_one_line_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
    with pytest.raises(DataError, match=r"^--data tfds:tiny_shakespeare needs the "
                       r"tensorflow-datasets package, which is not installed; install it "
                       r"with: pip install 'tfpar\[tfds\]' \(or pip install "
                       r"tensorflow-datasets\)$"):
        corpora.load_tfds("tiny_shakespeare")
