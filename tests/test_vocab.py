import math

import numpy as np
import pytest
import tensorflow as tf

from tfpar.errors import DataError
from tfpar.data.vocab import EOS_ID, PAD_ID, SPECIALS, UNK_ID, Vocab

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


def test_load_rejects_a_file_without_specials(tmp_path):
    p = tmp_path / "vocab.txt"
    p.write_text("a\nb\n")
    with pytest.raises(DataError, match="is not a tfpar vocabulary: it must start with <pad>"):
        Vocab.load(p)


def test_unigram_perplexity_matches_hand_computation():
    v = Vocab.build(["a a b"])
    # counts: pad 0, unk 0, eos 1, a 2, b 1 -> add-one over 5 entries: total 4 + 5 = 9.
    probs = {"a": 3 / 9, "b": 2 / 9, "eos": 2 / 9}
    expected = math.exp(-(math.log(probs["a"]) + math.log(probs["b"]) + math.log(probs["eos"])) / 3)
    assert v.unigram_perplexity(["a b"]) == pytest.approx(expected)
