import numpy as np
import pytest
import tensorflow as tf

from tfpar.config import DataConfig
from tfpar.errors import DataError
from tfpar.data.pipeline import (InputData, bucket_boundaries, count_tokens, per_replica,
                                  sentence_lengths, shard_bounds)
from tfpar.data.vocab import EOS_ID, PAD_ID, Vocab, length_histogram


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


@pytest.mark.parametrize("mode", ["sentence", "stream"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_replica_slices_of_one_pipeline_reassemble_the_global_batch(replicas, mode):
    data = make_data(make_lines(101), max_pad_fraction=0.3, mode=mode, bptt=7)
    global_batches = [b for b in data.batches("train", training=True, batch_size=10)]
    slices = list(data.batches("train", training=True, batch_size=10,
                               input_context=Ctx(replicas)))
    assert len(slices) == replicas * len(global_batches)
    for k, g in enumerate(global_batches):
        parts = slices[k * replicas:(k + 1) * replicas]
        assert sum((rows(s) for s in parts), []) == rows(g)
        for s in parts:  # never an empty replica batch
            assert s["targets"].shape[0] >= 1


def _epoch_lines(data, pipelines, replicas, epoch=0, workers=False):
    """Every sentence (target ids) each pipeline trains on in one epoch: multi_worker's
    input pipelines (``Ctx``), or parameter-server workers (a tensor index), whose
    batches are whole ones."""
    seen = []
    for p in range(pipelines):
        if workers:
            batches = data.batches("train", training=True, epoch=epoch, batch_size=4,
                                   worker=(pipelines, tf.constant(p)))
            assert max(len(rows(b)) for b in batches) == 4  # whole batches, not slices
        else:
            batches = data.batches("train", training=True, epoch=epoch, batch_size=12,
                                   input_context=Ctx(replicas, pipelines, p))
        seen.append([r for b in batches for r in rows(b)])
    return seen


@pytest.mark.parametrize("who", ["multi_worker", "parameter_server"])
@pytest.mark.parametrize("pipelines", [2, 3])
@pytest.mark.parametrize("files", [1, 5])
def test_input_pipelines_read_disjoint_shares_whose_union_is_the_corpus(tmp_path, pipelines,
                                                                        files, who):
    """With at least as many shard files as pipelines each reads its own files; with
    fewer, each keeps its share of the lines. An epoch over all pipelines is the corpus:
    nothing twice, nothing lost. So for multi_worker's input pipelines (rows of each
    global batch) and for parameter-server workers (whole batches; the worker index is
    a tensor)."""
    from tfpar.data.text import TextSplit

    lines = [f"s{i} " + " ".join(f"w{(i * 7 + j) % 40}" for j in range(i % 9)) for i in range(150)]
    paths = []
    for f in range(files):
        path = tmp_path / f"train-{f:03d}.txt"
        path.write_text("\n".join(lines[f::files]) + "\n")
        paths.append(path)
    split = TextSplit.of_files(paths)
    data = InputData({"train": split, "valid": lines[:5], "test": lines[:5]},
                     Vocab.build(lines), DataConfig(max_length=20), seed=3)
    seen = _epoch_lines(data, pipelines, replicas=2 * pipelines,
                        workers=who == "parameter_server")
    one_device = sorted(rows(b)[i] for b in data.batches("train", training=True, batch_size=12)
                        for i in range(len(rows(b))))
    union = sorted(r for mine in seen for r in mine)
    assert union == one_device  # nothing lost, nothing twice
    assert len(one_device) == len(lines)
    for a in range(pipelines):
        assert seen[a], "every pipeline gets sentences"
        for b in range(a + 1, pipelines):
            assert not set(seen[a]) & set(seen[b])
    if files >= pipelines:  # each pipeline read only its own files
        for p, mine in enumerate(seen):
            # Sentence "s<i>" is in file i % files; a pipeline reads whole files.
            files_read = {int(data.vocab.tokens[r[0]][1:]) % files for r in mine}
            assert len(files_read) == len(range(p, files, pipelines))
            assert len(mine) == sum(len(lines[f::files]) for f in files_read)


def test_a_resumed_worker_skips_its_turns_of_the_jobs_first_batches():
    """The job's first 3 batches, dealt in turn to 2 workers: 2 were worker 0's, 1 was
    worker 1's."""
    data = make_data(make_lines(200))
    for index, dropped in ((0, 2), (1, 1)):
        full, rest = ([rows(b) for b in data.batches("train", training=True, batch_size=8,
                                                     skip=skip, worker=(2, tf.constant(index)))]
                      for skip in (0, 3))
        assert rest == full[dropped:]


def test_a_stream_mode_worker_takes_every_wth_global_batch():
    data = make_data(make_lines(200), mode="stream", bptt=5)
    whole = [b["targets"].numpy() for b in data.batches("train", training=True, batch_size=4)]
    for index in (0, 1):
        mine = [b["targets"].numpy() for b in data.batches(
            "train", training=True, batch_size=4, worker=(2, tf.constant(index)))]
        assert len(mine) == len(whole[index::2])
        assert all((a == b).all() for a, b in zip(mine, whole[index::2]))


def test_the_log_says_how_workers_share_the_train_split():
    lines = make_lines(20)
    assert make_data(lines).share_summary("train", 2) == (
        "the train split has 1 file(s), fewer than the 2 workers: each reads them all and "
        "keeps one line in 2")
    assert make_data(lines, mode="stream").share_summary("train", 3).startswith(
        "stream mode: each of the 3 workers reads all of train (1 file")


def test_partial_batch_smaller_than_replicas_pads_empty_replicas():
    data = make_data(["a b"] * 3)
    slices = list(data.batches("valid", training=False, batch_size=8, input_context=Ctx(4)))
    assert len(slices) == 4
    assert [len(rows(s)) for s in slices] == [1, 1, 1, 0]
    assert int(tf.reduce_sum(slices[3]["targets"])) == 0


def test_bucket_boundaries_keep_padding_below_target():
    lengths = sentence_lengths(make_lines(5000, max_words=60), tokenizer="whitespace")
    bounds = bucket_boundaries(length_histogram(lengths), 80, 0.02)
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
    edges = [1] + bounds + [81]
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = lengths[(lengths >= lo) & (lengths < hi)]
        if inside.size:
            assert (inside.max() * inside.size - inside.sum()) / (inside.max() * inside.size) <= 0.02 + 1e-9


@pytest.mark.parametrize("pipelines", [2, 3])
def test_one_device_can_make_the_global_batches_of_several_pipelines(pipelines):
    """shared_batches: batch k is every pipeline's k-th batch, in pipeline order, with
    their global row keys (the verify tool's multi_worker reference)."""
    data = make_data(make_lines(90), max_pad_fraction=0.3)
    per = [list(data.batches("train", training=True, epoch=1, batch_size=12,
                             input_context=Ctx(pipelines, pipelines, p)))
           for p in range(pipelines)]
    shared = list(data.batches("train", training=True, epoch=1, batch_size=12,
                               shares=pipelines))
    assert len(shared) == max(len(b) for b in per)
    for k, g in enumerate(shared):
        parts = [b[k] for b in per if k < len(b)]
        assert rows(g) == sum((rows(b) for b in parts), [])
        np.testing.assert_array_equal(g["rows"], np.concatenate([b["rows"] for b in parts]))


def test_stream_mode_rows_are_contiguous_byte_ranges_of_the_split():
    lines = [f"t{i}" for i in range(40)]  # stream: t0 <eos> t1 <eos> ...
    data = make_data(lines, mode="stream", bptt=3)
    batches = list(data.batches("train", training=False, batch_size=2))
    inputs = np.concatenate([b["inputs"].numpy() for b in batches], axis=1)
    targets = np.concatenate([b["targets"].numpy() for b in batches], axis=1)
    assert all(b["inputs"].shape[1] <= 3 for b in batches)
    stream = np.array(data.vocab.encode(" ".join(f"t{i} <eos>" for i in range(40))))
    rebuilt = []
    for row_in, row_out in zip(inputs, targets):
        real = row_out != PAD_ID
        # Each row is one token stream: its targets are its inputs one step on.
        np.testing.assert_array_equal(row_in[1:][real[1:]], row_out[:-1][real[1:]])
        rebuilt += [row_in[0]] + list(row_out[real])
    # Row 1 starts where row 0 ends: together they are the whole stream, in order.
    np.testing.assert_array_equal(rebuilt, stream)
    # Cut at the first line start at or after half the 150 bytes ("t0\n".."t9\n" are 3
    # bytes, the rest 4): byte 78, after t21, so row 0 holds 22 lines, 44 tokens.
    assert (targets[0] != PAD_ID).sum() == 44 - 1


def test_stream_mode_rows_without_text_are_padding():
    data = make_data(["a b", "c"], mode="stream")
    batches = list(data.batches("valid", training=False, batch_size=8))
    real, slots = count_tokens(tf.data.Dataset.from_tensor_slices([0]).flat_map(lambda _: data.batches("valid", training=False, batch_size=8)))
    assert real == 5 - 2  # two non-empty rows, each predicts all but its first token
    assert all(b["targets"].shape[0] == 8 for b in batches)


def test_empty_split_is_an_error():
    with pytest.raises(DataError, match="the valid split has no sentences"):
        InputData({"train": ["a"], "valid": [], "test": ["a"]}, Vocab.build(["a"]), DataConfig())
