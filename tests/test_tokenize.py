"""tfpar.data.tokenize: exact tokens of every tokenizer, decoding, and that the vocabulary,
the input pipeline and the serving helpers all split text the same way."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tfpar.config import Config, DataConfig
from conftest import sentence_lengths, small_config
from tfpar.data.pipeline import InputData
from tfpar.data.tokenize import TOKENIZERS, join_tokens, split_tokens
from tfpar.data.vocab import EOS, EOS_ID, Vocab
from tfpar.errors import ConfigError
from tfpar.serving import sample

# Punctuation runs, Unicode letters and marks, several spaces, tabs, an empty line,
# Unicode spaces, a stray carriage return.
TRICKY = [
    "Citizen: you, sir!",
    "wait...   what?!  (no)",
    "naïve café\tdéjà-vu",
    "",
    "\t  lead and trail  \t",
    "a\u00a0b\u2003c",
    "x\ry",
    "it's 3.14 — e\u0301 ok",
]


def tokens(lines, tokenizer):
    return [[t.decode("utf-8") for t in row] for row in split_tokens(lines, tokenizer).to_list()]


def test_whitespace_is_todays_split_at_ascii_whitespace():
    assert tokens(TRICKY, "whitespace") == [
        ["Citizen:", "you,", "sir!"],
        ["wait...", "what?!", "(no)"],
        ["naïve", "café", "déjà-vu"],
        [],
        ["lead", "and", "trail"],
        ["a\u00a0b\u2003c"],  # Unicode spaces stay inside the token, as tf.strings.split has it
        ["x", "y"],
        ["it's", "3.14", "—", "e\u0301", "ok"],
    ]
    ascii_lines = [line for line in TRICKY if line.isascii()]
    assert tokens(ascii_lines, "whitespace") == [line.split() for line in ascii_lines]


def test_punct_keeps_word_runs_and_splits_off_every_other_character():
    assert tokens(TRICKY, "punct") == [
        ["Citizen", ":", "you", ",", "sir", "!"],
        ["wait", ".", ".", ".", "what", "?", "!", "(", "no", ")"],
        ["naïve", "café", "déjà", "-", "vu"],
        [],
        ["lead", "and", "trail"],
        ["a", "b", "c"],  # Unicode spaces separate here
        ["x", "y"],
        ["it", "'", "s", "3", ".", "14", "—", "e\u0301", "ok"],  # a combining mark is a letter's
    ]


def test_char_keeps_every_character_and_makes_a_line_break_eos():
    assert tokens(["a b", "\tc  d", "", "x\ry", "e\u0301", "one\ntwo"], "char") == [
        ["a", " ", "b"],
        ["\t", "c", " ", " ", "d"],
        [],
        ["x", "y"],
        ["e", "\u0301"],
        ["o", "n", "e", EOS, "t", "w", "o"],
    ]


def test_join_puts_spaces_between_words_nothing_between_characters_and_lines_apart():
    words = tf.ragged.constant([["Citizen", ":", "you", "\n", "sir", "!", "\n"]])
    assert join_tokens(words, "punct").numpy()[0].decode() == "Citizen : you\nsir !\n"
    assert join_tokens(words, "whitespace").numpy()[0].decode() == "Citizen : you\nsir !\n"
    lines = [line for line in TRICKY if "\r" not in line]
    assert [t.decode() for t in join_tokens(split_tokens(lines, "char"), "char").numpy()] == lines
    chars = tf.ragged.constant([["a", " ", "b", "\n", " ", "c"]])
    assert join_tokens(chars, "char").numpy()[0].decode() == "a b\n c"


@pytest.mark.parametrize("call", [
    lambda: split_tokens(["a"], "bpe"),
    lambda: join_tokens(tf.ragged.constant([["a"]]), "bpe"),
    lambda: Vocab.build(["a"], tokenizer="bpe"),
    lambda: DataConfig(tokenizer="bpe"),
])
def test_an_unknown_tokenizer_is_a_one_line_error_listing_the_choices(call):
    with pytest.raises(ConfigError,
                       match=r"^unknown tokenizer 'bpe'; expected one of: whitespace, punct, "
                             r"char$"):
        call()


def test_a_config_json_without_the_new_fields_means_whitespace_and_default_fractions():
    old = json.loads(small_config().to_json())
    del old["data"]["tokenizer"], old["data"]["split_fractions"]
    data = Config.from_dict(old).data
    assert (data.tokenizer, data.split_fractions) == ("whitespace", (0.9, 0.05, 0.05))
    new = small_config().replace(data={"tokenizer": "char", "split_fractions": (0.8, 0.1, 0.1)})
    assert Config.from_json(new.to_json()) == new  # JSON lists come back as the tuple


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_vocabulary_pipeline_and_serving_split_text_the_same_way(tokenizer):
    lines = [line.strip() for line in TRICKY if line.strip()] * 2  # as corpora read them
    vocab = Vocab.build(lines, tokenizer=tokenizer)
    expected = tokens(lines, tokenizer)
    # The vocabulary holds exactly the tokens split_tokens makes, counted right.
    flat = [t for row in expected for t in row]
    assert set(vocab.tokens[3:]) == set(flat) - {EOS}
    for token, count in zip(vocab.tokens[3:], vocab.counts[3:]):
        assert count == flat.count(token)
    # The pipeline's examples are those tokens' ids between <eos>s.
    config = DataConfig(tokenizer=tokenizer, max_length=200)
    data = InputData({"train": lines, "valid": lines, "test": lines}, vocab, config)
    got = [[int(i) for i in row if i] for batch in data.batches("valid", training=False,
                                                                 batch_size=len(lines))
           for row in batch["targets"].numpy()]
    want = [[vocab.tokens.index(t) for t in row] + [EOS_ID] for row in expected]
    assert sorted(got) == sorted(want)  # buckets reorder the rows
    np.testing.assert_array_equal(sentence_lengths(lines, tokenizer=tokenizer),
                                  [len(row) for row in want])  # tokens + <eos>
    # Serving (score, generate) reads prompts with the same ids.
    ids = sample.word_ids(tf.constant(lines), vocab.lookup_table(), tokenizer=tokenizer)
    assert [row + [EOS_ID] for row in ids.to_list()] == want
    assert [vocab.encode(line) for line in lines] == [row[:-1] for row in want]


def test_vocab_decode_joins_as_the_tokenizer_does():
    chars = Vocab.build(["ab a"], tokenizer="char")
    ids = chars.encode("a b") + [EOS_ID] + chars.encode("ba")
    assert chars.decode(ids) == "a b\nba"
    words = Vocab.build(["sir, you"], tokenizer="punct")
    assert words.decode(words.encode("you, sir") + [EOS_ID]) == "you , sir\n"


def test_unigram_perplexity_counts_tokens_of_the_tokenizer():
    chars = Vocab.build(["aab"], tokenizer="char")
    # counts: pad 0, unk 0, eos 1, a 2, b 1 -> add-one over 5 entries: total 4 + 5 = 9.
    p = {"a": 3 / 9, "b": 2 / 9, "eos": 2 / 9}
    expected = np.exp(-(np.log(p["a"]) + np.log(p["b"]) + np.log(p["eos"])) / 3)
    assert chars.unigram_perplexity(["ab"]) == pytest.approx(expected)


def test_input_data_refuses_a_vocabulary_of_another_tokenizer():
    from tfpar.errors import DataError

    vocab = Vocab.build(["a b"], tokenizer="char")
    with pytest.raises(DataError, match=r"the vocabulary was built with the 'char' tokenizer "
                                        r"but the data config asks for 'whitespace'"):
        InputData({"train": ["a b"], "valid": ["a"], "test": ["b"]}, vocab, DataConfig())
