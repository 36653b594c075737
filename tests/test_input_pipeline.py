import numpy as np
import pytest
import tensorflow as tf

from tfpar.config import DataConfig
from tfpar.errors import DataError
from tfpar.data.pipeline import (InputData, bucket_boundaries, count_tokens, per_replica,
                                  sentence_lengths, shard_bounds)
from tfpar.data.vocab import EOS_ID, PAD_ID, Vocab


def make_lines(n, seed=0, max_words=30):
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{int(x)}" for x in rng.integers(0, 50, size=rng.integers(1, max_words)))
            for _ in range(n)]


def make_data(lines, **kw):
    splits = {"train": lines, "valid": lines[:20], "test": lines[:10]}
    return InputData(splits, Vocab.build(lines), DataConfig(**kw), seed=1)


class Ctx:
    """A stand-in for tf.distribute.InputContext (only the fields the pipeline reads)."""

    def __init__(self, replicas, pipelines=1, pipeline_id=0):
        self.num_replicas_in_sync = replicas
        self.num_input_pipelines = pipelines
        self.input_pipeline_id = pipeline_id


def rows(batch):
    """Real (non-padding) rows of a batch as tuples of target ids without padding."""
    return [tuple(int(t) for t in r if t != PAD_ID) for r in batch["targets"].numpy()
            if (r != PAD_ID).any()]


def test_sentence_example_structure():
    data = make_data(["a b c"] * 3)
    batch = next(iter(data.batches("valid", training=False, batch_size=8)))
    v = data.vocab
    a, b, c = (v.tokens.index(w) for w in "abc")
    assert batch["inputs"].dtype == tf.int32
    np.testing.assert_array_equal(batch["inputs"].numpy()[0], [EOS_ID, a, b, c])
    np.testing.assert_array_equal(batch["targets"].numpy()[0], [a, b, c, EOS_ID])


def test_every_token_once_and_padding_low():
    lines = make_lines(2000)
    data = make_data(lines, max_pad_fraction=0.02)
    real, slots = count_tokens(data.batches("train", training=True, batch_size=16))
    assert real == sentence_lengths(lines, tokenizer="whitespace").sum()
    assert (slots - real) / slots < 0.05


def test_shuffle_is_seeded_and_changes_per_epoch():
    data = make_data(make_lines(300))
    first = [rows(b) for b in data.batches("train", training=True, epoch=0, batch_size=8)]
    again = [rows(b) for b in data.batches("train", training=True, epoch=0, batch_size=8)]
    other = [rows(b) for b in data.batches("train", training=True, epoch=1, batch_size=8)]
    assert first == again
    assert first != other
    assert sorted(sum(first, [])) == sorted(sum(other, []))


def test_skip_resumes_at_the_same_batch():
    data = make_data(make_lines(300))
    full = [rows(b) for b in data.batches("train", training=True, epoch=2, batch_size=8)]
    tail = [rows(b) for b in data.batches("train", training=True, epoch=2, skip=5, batch_size=8)]
    assert tail == full[5:]


@pytest.mark.parametrize("policy,expect_tokens", [("split", 12), ("truncate", 5)])
def test_long_sentences_split_or_truncate(policy, expect_tokens):
    data = make_data(["x " * 11, "y"], max_length=5, long_sentences=policy)
    real, _ = count_tokens(data.batches("train", training=False, batch_size=4))
    assert real == expect_tokens + 2  # plus the short sentence "y <eos>"
    for batch in data.batches("train", training=False, batch_size=4):
        assert batch["targets"].shape[1] <= 5


@pytest.mark.parametrize("rows_,shards", [(10, 3), (2, 4), (8, 4), (1, 1)])
def test_shard_bounds_cover_rows_exactly_once(rows_, shards):
    covered = []
    sizes = []
    for i in range(shards):
        start, size = (int(x) for x in shard_bounds(tf.constant(rows_), shards, tf.constant(i)))
        covered += list(range(start, start + size))
        sizes.append(size)
    assert covered == list(range(rows_))
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("replicas,pipelines", [(2, 1), (3, 1), (4, 2)])
def test_replica_slices_reassemble_the_global_batch(replicas, pipelines):
    data = make_data(make_lines(101), max_pad_fraction=0.3)
    global_batches = [b for b in data.batches("train", training=True, batch_size=10)]
    per_pipeline = [list(data.batches("train", training=True, batch_size=10,
                                      input_context=Ctx(replicas, pipelines, p)))
                    for p in range(pipelines)]
    local = replicas // pipelines
    for k, g in enumerate(global_batches):
        parts = []
        for p in range(pipelines):
            parts += per_pipeline[p][k * local:(k + 1) * local]
        assert sum((rows(s) for s in parts), []) == rows(g)
        for s in parts:  # never an empty replica batch
            assert s["targets"].shape[0] >= 1


def test_partial_batch_smaller_than_replicas_pads_empty_replicas():
    data = make_data(["a b"] * 3)
    slices = list(data.batches("valid", training=False, batch_size=8, input_context=Ctx(4)))
    assert len(slices) == 4
    assert [len(rows(s)) for s in slices] == [1, 1, 1, 0]
    assert int(tf.reduce_sum(slices[3]["targets"])) == 0


def test_bucket_boundaries_keep_padding_below_target():
    lengths = sentence_lengths(make_lines(5000, max_words=60), tokenizer="whitespace")
    bounds = bucket_boundaries(lengths, 80, 0.02)
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
    edges = [1] + bounds + [81]
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = lengths[(lengths >= lo) & (lengths < hi)]
        if inside.size:
            assert (inside.max() * inside.size - inside.sum()) / (inside.max() * inside.size) <= 0.02 + 1e-9


def test_stream_mode_columns_are_contiguous():
    lines = [f"t{i}" for i in range(40)]  # stream: t0 <eos> t1 <eos> ...
    data = make_data(lines, mode="stream", bptt=3)
    batches = list(data.batches("train", training=False, batch_size=2))
    inputs = np.concatenate([b["inputs"].numpy() for b in batches], axis=1)
    targets = np.concatenate([b["targets"].numpy() for b in batches], axis=1)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    columns = 80 // 2
    assert inputs.shape == (2, columns - 1)
    assert all(b["inputs"].shape[1] <= 3 for b in batches)
    # Row 1 starts where row 0's column ends in the stream.
    stream = np.array(data.vocab.encode(" ".join(f"t{i} <eos>" for i in range(40))))
    np.testing.assert_array_equal(inputs[1], stream[columns:2 * columns - 1])


def test_stream_mode_too_few_tokens_is_an_error():
    data = make_data(["a"], mode="stream")
    with pytest.raises(DataError, match="too few for 64 stream columns; use a smaller --batch-size"):
        data.batches("valid", training=False, batch_size=64)


def test_empty_split_is_an_error():
    with pytest.raises(DataError, match="the valid split has no sentences"):
        InputData({"train": ["a"], "valid": [], "test": ["a"]}, Vocab.build(["a"]), DataConfig())
