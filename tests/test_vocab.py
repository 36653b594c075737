import math
import os
from pathlib import Path

import pytest
import tensorflow as tf

from tfpar.errors import DataError
from tfpar.data.vocab import EOS_ID, PAD_ID, SPECIALS, UNK_ID, Vocab, first_difference

LINES = ["b a c", "a b", "a <unk> d", "c c"]


def test_specials_first_then_frequency_with_word_tie_break():
    v = Vocab.build(LINES)
    # a:3, c:3, b:2, d:1; ties broken alphabetically.
    assert v.tokens == SPECIALS + ("a", "c", "b", "d")
    assert (PAD_ID, UNK_ID, EOS_ID) == (0, 1, 2)
    assert v.counts[:3] == (0, 1, 4)  # one <unk> in the text; one <eos> per line


def test_vocab_size_and_min_count_send_the_rest_to_unk():
    v = Vocab.build(LINES, max_size=5)
    assert v.tokens == SPECIALS + ("a", "c")
    assert v.counts[UNK_ID] == 1 + 2 + 1  # <unk> in text, two b, one d
    assert Vocab.build(LINES, min_count=3).tokens == SPECIALS + ("a", "c")


def test_lookup_table_maps_oov_to_unk():
    v = Vocab.build(LINES)
    table = v.lookup_table()
    ids = table.lookup(tf.constant(["a", "d", "zzz", "<eos>", "<unk>"])).numpy().tolist()
    assert ids == [3, 6, UNK_ID, EOS_ID, UNK_ID]
    assert v.encode("a zzz d") == [3, UNK_ID, 6]
    assert v.decode([3, 6, 0]) == "a d"


def test_save_load_round_trip(tmp_path):
    v = Vocab.build(LINES)
    path = v.save(tmp_path)
    assert Vocab.load(path).tokens == v.tokens
    assert not list(tmp_path.glob("*.tmp"))


HEAD = "<pad>\n<unk>\n<eos>\n"


@pytest.mark.parametrize("content,message", [
    (b"", "is empty; it must start with the lines <pad>, <unk>, <eos>, then one token per "
          "line (line number = id)"),
    (b"a\nb\n", "is not a tfpar vocabulary: line 1 holds 'a', not '<pad>'; it must start "
                 "with the lines <pad>, <unk>, <eos>"),
    (b"<pad>\n<eos>\n<unk>\na\n", "is not a tfpar vocabulary: line 2 holds '<eos>', not "
                                   "'<unk>'; it must start with the lines <pad>, <unk>, <eos>"),
    (b"<pad>\n\n<eos>\na\n", "is not a tfpar vocabulary: line 2 holds '', not '<unk>'"),
    (b"<pad>\n<unk>\n", "is not a tfpar vocabulary: it ends after line 2; it must start "
                        "with the lines <pad>, <unk>, <eos>"),
    (HEAD.encode(), "holds only <pad>, <unk>, <eos>; it needs at least one word after them"),
    ((HEAD + "a\nb\na\n").encode(), "token 'a' is on line 4 and again on line 6; every token "
                                    "must appear once"),
    ((HEAD + "a\n<unk>\n").encode(), "token '<unk>' is on line 2 and again on line 5"),
    ((HEAD + "a\n\nb\n").encode(), "line 5 is empty; every line must hold one token (remove "
                                   "the blank line)"),
    ((HEAD + "a\n\n").encode(), "line 5 is empty"),  # a blank line after the last token
    (HEAD.replace("\n", "\r\n").encode() + b"a\r\n",
     "line 1 ('<pad>\\r') holds a carriage return; lines must end with \\n only (convert "
     "it, e.g. dos2unix)"),
    (HEAD.encode() + b"a\0b\n", "is binary, not text (NUL byte at offset 19); it must be UTF-8 "
                                "text with one token per line (line number = id)"),
    (HEAD.encode() + "café\n".encode("latin-1"),
     "is not UTF-8: byte 0xe9 at offset 21 cannot be decoded; re-encode the file as UTF-8"),
])
def test_load_rejects_a_malformed_file_naming_the_line(content, message, tmp_path):
    p = tmp_path / "v.txt"
    p.write_bytes(content)
    with pytest.raises(DataError) as e:
        Vocab.load(p)
    assert str(e.value).startswith(f"vocabulary file {p}")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_load_a_missing_file_or_a_folder(tmp_path):
    with pytest.raises(DataError, match=rf"^vocabulary file {tmp_path}/nope\.txt does not "
                                        r"exist; give the path of a UTF-8 text file with one "
                                        r"token per line \(line number = id\)$"):
        Vocab.load(tmp_path / "nope.txt")
    with pytest.raises(DataError, match=rf"^vocabulary file {tmp_path} is a folder; it must be "
                                        r"a UTF-8 text file with one token per line"):
        Vocab.load(tmp_path)


def test_load_an_unreadable_file(tmp_path, monkeypatch):
    p = tmp_path / "v.txt"
    p.write_text(HEAD + "a\n")
    p.chmod(0)
    if os.access(p, os.R_OK):  # root reads anything, so fake the refusal
        real = Path.read_bytes

        def refuse(self):
            if self == p:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(DataError, match=rf"^cannot read vocabulary file {p}: permission denied; "
                                        rf"make it readable \(e\.g\. chmod a\+r {p}\)$"):
        Vocab.load(p)


def test_load_accepts_a_byte_order_mark_no_final_line_break_and_a_space_token(tmp_path):
    p = tmp_path / "v.txt"
    p.write_bytes(b"\xef\xbb\xbf" + (HEAD + "a\n \né").encode())
    v = Vocab.load(p, tokenizer="char")
    assert v.tokens == SPECIALS + ("a", " ", "é")
    assert v.tokenizer == "char" and v.counts == () and not v.has_counts
    assert v.encode("a é") == [3, 4, 5]


def test_a_loaded_vocab_has_no_unigram_perplexity(tmp_path):
    v = Vocab.build(LINES)
    assert v.has_counts
    with pytest.raises(DataError, match="unigram perplexity needs a vocabulary built from "
                                        "train counts"):
        Vocab.load(v.save(tmp_path)).unigram_perplexity(LINES)


def test_build_refuses_a_vocabulary_of_no_word():
    with pytest.raises(DataError, match=r"^the train split has no word seen at least 9 time\(s\) "
                                        r"\(min-count\) besides <pad>, <unk>, <eos>, so the "
                                        r"vocabulary would hold no word; lower --min-count$"):
        Vocab.build(LINES, min_count=9)


def test_first_difference_names_the_line():
    a = Vocab(tokens=SPECIALS + ("x", "y"))
    assert first_difference(a, a) == ""
    assert first_difference(a, Vocab(tokens=SPECIALS + ("x", "z"))) == "line 5: 'y' against 'z'"
    assert first_difference(a, Vocab(tokens=SPECIALS + ("x",))) == "line 5: 'y' against no line"
    assert first_difference(Vocab(tokens=SPECIALS + ("x",)), a) == "line 5: no line against 'y'"


def test_unigram_perplexity_matches_hand_computation():
    v = Vocab.build(["a a b"])
    # counts: pad 0, unk 0, eos 1, a 2, b 1 -> add-one over 5 entries: total 4 + 5 = 9.
    probs = {"a": 3 / 9, "b": 2 / 9, "eos": 2 / 9}
    expected = math.exp(-(math.log(probs["a"]) + math.log(probs["b"]) + math.log(probs["eos"])) / 3)
    assert v.unigram_perplexity(["a b"]) == pytest.approx(expected)
