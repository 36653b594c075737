import os

import numpy as np
import pytest
import tensorflow as tf

from tfpar.config import DataConfig
from tfpar.errors import DataError
from tfpar.data.pipeline import InputData, bucket_boundaries, count_tokens
from tfpar.data.vocab import EOS_ID, PAD_ID, Vocab
from tfpar.parallel.parameter_server import worker_batches
from tfpar.parallel.rows import Context as Ctx
from tfpar.parallel.rows import replica_batches, shard_bounds
from tfpar.tools.verify import shared_batches

from conftest import length_histogram, sentence_lengths, shared_data_dir


def make_lines(n, seed=0, max_words=30):
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{int(x)}" for x in rng.integers(0, 50, size=rng.integers(1, max_words)))
            for _ in range(n)]


def make_data(lines, **kw):
    splits = {"train": lines, "valid": lines[:20], "test": lines[:10]}
    return InputData(splits, Vocab.build(lines), DataConfig(**kw), seed=1)


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


def test_every_line_once_and_padding_low():
    """A sentence-mode epoch's rows, as a multiset, are exactly the corpus's lines
    (<eos> w1 .. wn -> w1 .. wn <eos>, ids computed without tfpar's tokenizer)."""
    lines = make_lines(2000)
    data = make_data(lines, max_pad_fraction=0.02)
    batches = list(data.batches("train", training=True, batch_size=16))
    got = sorted(r for b in batches for r in rows(b))
    assert got == sorted(tuple(ids + [EOS_ID]) for ids in reference_ids(lines, data.vocab))
    inputs = sorted(tuple(int(t) for t in r if t != PAD_ID)
                    for b in batches for r in b["inputs"].numpy())
    assert inputs == sorted(tuple([EOS_ID] + ids) for ids in reference_ids(lines, data.vocab))
    real, slots = count_tokens(data.batches("train", training=False, batch_size=16))
    assert real == sum(len(ids) + 1 for ids in reference_ids(lines, data.vocab))
    assert (slots - real) / slots < 0.05
    # Training mixes the buckets' leftovers (one per bucket, here 15 of 125 batches) into
    # batches of all lengths: padded to their longest, they cost a few points more.
    real, slots = count_tokens(data.batches("train", training=True, batch_size=16))
    assert (slots - real) / slots < 0.10


def test_sentence_mode_batches_are_full_except_the_epochs_last():
    """The buckets' partial last batches are joined: an epoch never ends with dozens of
    steps of a few rows each (full-size updates from a handful of sentences)."""
    lines = make_lines(2000)
    data = make_data(lines)
    for training in (True, False):
        sizes = [b["targets"].shape[0] for b in data.batches("train", training=training,
                                                             batch_size=16)]
        assert len(data.boundaries) >= 5  # several buckets, each with a partial batch
        assert set(sizes[:-1]) == {16}
        assert sizes[-1] == 2000 - 16 * (len(sizes) - 1)


def _partial_batches():
    def batch(rows, length):
        x = np.zeros([len(rows), length], np.int32)
        for i, r in enumerate(rows):
            x[i, :len(r)] = r
        return {"inputs": x, "targets": x}

    parts = [batch([[1, 2], [3, 4]], 2), batch([[5]], 4), batch([[6, 7, 8]], 3),
             batch([[9, 9], [9, 9]], 2), batch([[10]], 1)]
    return tf.data.Dataset.from_generator(
        lambda: iter(parts), output_signature={k: tf.TensorSpec([None, None], tf.int32)
                                               for k in ("inputs", "targets")})


def test_fill_partial_batches_keeps_partial_rows_for_the_end_and_trims_padding():
    from tfpar.data.pipeline import fill_partial_batches

    out = [b["inputs"].numpy().tolist() for b in fill_partial_batches(_partial_batches(), 2)]
    # Full batches pass through; [5], [6 7 8] and [10] end the epoch (unshuffled: in order).
    assert out == [[[1, 2], [3, 4]], [[9, 9], [9, 9]], [[5, 0, 0], [6, 7, 8]], [[10]]]


def test_the_epoch_does_not_end_with_its_longest_sentences():
    """The buckets' leftovers, flushed shortest bucket first, must not be the epoch's
    last updates in that order: lr-20 SGD's final weights then think sentences never
    end (tfpar/docs/quality.md, Sentence ends)."""
    data = make_data(make_lines(2000, seed=3))
    lengths = [(b["targets"].numpy() != 0).sum(1)
               for b in data.batches("train", training=True, batch_size=16)]
    # Flushed in bucket order, the last batches are each one bucket's rows, the very last
    # the longest (spreads 1, 2, 4 words); mixed, each holds sentences of many lengths.
    assert np.mean([x.max() - x.min() for x in lengths[-3:]]) > 5


def test_fill_partial_batches_mixes_the_partial_rows_by_the_seed():
    from tfpar.data.pipeline import fill_partial_batches

    runs = {seed: [b["inputs"].numpy().tolist()
                   for b in fill_partial_batches(_partial_batches(), 2, seed=seed)]
            for seed in (0, 0, 1, 2, 3)}
    rows = lambda out: sorted(tuple(t for t in r if t) for b in out for r in b)  # noqa: E731
    assert all(rows(out) == rows(runs[0]) for out in runs.values())  # the same rows
    assert all(out[:2] == [[[1, 2], [3, 4]], [[9, 9], [9, 9]]] for out in runs.values())
    assert len({str(out) for out in runs.values()}) > 1  # in an order the seed sets


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


@pytest.mark.parametrize("policy", ["split", "truncate"])
def test_every_piece_of_a_long_sentence_is_its_consecutive_slice(policy):
    """Sentences of 1 to 17 words, --max-length 5: each example (inputs and targets) is a
    slice [5i, 5i + 5) of its sentence's <eos> w1 … wn <eos> shifted pair (split: every
    slice, the last holding the rest; truncate: the first), computed here in Python."""
    lines = [" ".join(f"w{k}" for k in range(n)) for n in range(1, 18)]
    data = make_data(lines, max_length=5, long_sentences=policy)
    want = []
    for line in lines:
        ids = [EOS_ID, *data.vocab.encode(line), EOS_ID]
        inputs, targets = ids[:-1], ids[1:]
        starts = range(0, len(targets), 5) if policy == "split" else [0]
        want += [(tuple(inputs[i:i + 5]), tuple(targets[i:i + 5])) for i in starts]
    got = []
    for batch in data.batches("train", training=False, batch_size=4):
        for x, t in zip(batch["inputs"].numpy(), batch["targets"].numpy()):
            n = int((t != PAD_ID).sum())
            got.append((tuple(int(v) for v in x[:n]), tuple(int(v) for v in t[:n])))
    assert sorted(got) == sorted(want)


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
    slices = list(replica_batches(data, "train", training=True, batch_size=10,
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
            batches = worker_batches(data, "train", training=True, epoch=epoch, batch_size=4,
                                     workers=pipelines, index=tf.constant(p))
            assert max(len(rows(b)) for b in batches) == 4  # whole batches, not slices
        else:
            batches = replica_batches(data, "train", training=True, epoch=epoch,
                                      batch_size=12, input_context=Ctx(replicas, pipelines, p))
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
        full, rest = ([rows(b) for b in worker_batches(data, "train", training=True,
                                                       batch_size=8, skip=skip, workers=2,
                                                       index=tf.constant(index))]
                      for skip in (0, 3))
        assert rest == full[dropped:]


def test_a_stream_mode_worker_takes_every_wth_global_batch():
    data = make_data(make_lines(200), mode="stream", bptt=5)
    whole = [b["targets"].numpy() for b in data.batches("train", training=True, batch_size=4)]
    for index in (0, 1):
        mine = [b["targets"].numpy() for b in worker_batches(
            data, "train", training=True, batch_size=4, workers=2, index=tf.constant(index))]
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
    slices = list(replica_batches(data, "valid", training=False, batch_size=8,
                                  input_context=Ctx(4)))
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
    per = [list(replica_batches(data, "train", training=True, epoch=1, batch_size=12,
                                input_context=Ctx(pipelines, pipelines, p)))
           for p in range(pipelines)]
    shared = list(shared_batches(data, "train", 12, pipelines, shuffle=True, epoch=1))
    assert len(shared) == max(len(b) for b in per)
    for k, g in enumerate(shared):
        parts = [b[k] for b in per if k < len(b)]
        assert rows(g) == sum((rows(b) for b in parts), [])
        np.testing.assert_array_equal(g["rows"], np.concatenate([b["rows"] for b in parts]))


def reference_ids(lines, vocab):
    """The token ids of ``lines`` computed without tfpar's tokenizer or lookup table:
    ``str.split`` and the vocabulary's token list (unknown words -> <unk>)."""
    index = {w: i for i, w in enumerate(vocab.tokens)}
    return [[index.get(w, 1) for w in line.split()] for line in lines if line.strip()]


def reference_columns(lines, vocab, columns):
    """[B, C]: the stream (every line's ids then <eos>) cut into B contiguous columns of
    C = N // B tokens, the remainder left out (classic ``batchify``)."""
    stream = np.array([t for ids in reference_ids(lines, vocab) for t in ids + [EOS_ID]])
    length = len(stream) // columns
    return stream[:columns * length].reshape(columns, length)


def read_columns(data, split, batch_size):
    """The stream batches of ``split`` joined back into [B, C] columns."""
    batches = list(data.batches(split, training=False, batch_size=batch_size))
    inputs = np.concatenate([b["inputs"].numpy() for b in batches], axis=1)
    targets = np.concatenate([b["targets"].numpy() for b in batches], axis=1)
    return batches, inputs, targets


@pytest.mark.parametrize("batch_size,bptt", [(2, 3), (5, 4), (7, 35)])
def test_stream_mode_rows_are_the_token_stream_cut_into_equal_columns(batch_size, bptt):
    """Every row is one contiguous column of the corpus's token stream, all of one length,
    so every row has a real token in every window (no row runs on alone at the end)."""
    lines = make_lines(200, seed=3)
    data = make_data(lines, mode="stream", bptt=bptt)
    batches, inputs, targets = read_columns(data, "train", batch_size)
    expected = reference_columns(lines, data.vocab, batch_size)
    np.testing.assert_array_equal(inputs, expected[:, :-1])
    np.testing.assert_array_equal(targets, expected[:, 1:])
    assert all(b["inputs"].shape[1] == bptt for b in batches[:-1])
    assert 1 <= batches[-1]["inputs"].shape[1] <= bptt
    assert all((b["targets"].numpy() != PAD_ID).all() for b in batches)


def test_stream_mode_columns_cut_inside_lines_and_files(tmp_path):
    """Columns start wherever the token count says, inside a line or a shard file."""
    from tfpar.data.text import TextSplit

    lines = [f"t{i} " * (1 + i % 7) for i in range(60)]
    paths = []
    for k in range(3):  # three shards, read in order
        paths.append(tmp_path / f"part-{k}.txt")
        paths[-1].write_text("\n\n".join(lines[k * 20:(k + 1) * 20]) + "\n", encoding="utf-8")
    vocab = Vocab.build(lines)
    split = TextSplit.of_files(paths)
    data = InputData({"train": split, "valid": split, "test": split}, vocab,
                     DataConfig(mode="stream", bptt=4))
    _, inputs, targets = read_columns(data, "valid", 6)
    expected = reference_columns(lines, vocab, 6)
    np.testing.assert_array_equal(inputs, expected[:, :-1])
    np.testing.assert_array_equal(targets, expected[:, 1:])


def test_stream_mode_rows_on_ptb_are_its_token_stream_in_20_columns():
    """The real corpus, read as training reads it: PTB valid in 20 columns of 3,688."""
    folder = os.path.join(shared_data_dir(), "ptb")
    if not os.path.isdir(folder):
        pytest.skip(f"the shared corpora folder {folder} is absent (set TFPAR_SHARED_DATA)")
    from tfpar.data.text import TextSplit

    path = os.path.join(folder, "ptb.valid.txt")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    split = TextSplit.of_files([path])
    vocab = Vocab.build(lines)
    data = InputData({"train": split, "valid": split, "test": split}, vocab,
                     DataConfig(mode="stream", bptt=35))
    batches, inputs, targets = read_columns(data, "valid", 20)
    expected = reference_columns(lines, vocab, 20)
    assert expected.shape == (20, 3688) and len(batches) == 106
    np.testing.assert_array_equal(inputs, expected[:, :-1])
    np.testing.assert_array_equal(targets, expected[:, 1:])


def test_stream_mode_with_fewer_than_two_tokens_a_column_is_an_error():
    data = make_data(["a b", "c"], mode="stream")
    with pytest.raises(DataError, match=r"the valid split has 5 tokens, too few for 8 stream "
                       r"columns of at least 2 tokens; use a batch size of at most 2 "):
        next(iter(data.batches("valid", training=False, batch_size=8)))


def test_empty_split_is_an_error():
    with pytest.raises(DataError, match="the valid split has no sentences"):
        InputData({"train": ["a"], "valid": [], "test": ["a"]}, Vocab.build(["a"]), DataConfig())


def test_the_input_pipeline_is_built_without_autograph(monkeypatch):
    """tf.data hands each function it traces to autograph unless it is marked: no function
    of either mode's pipeline (train, valid, two replicas' shares, the stream columns'
    token count) is rewritten. Autograph rewrote the stream column reader and everything
    it calls, 2.8 s of a tiny run's valid split, and could not parse two lambdas."""
    from tensorflow.python.autograph.impl import api

    converted = []
    real = api._convert_actual

    def spy(entity, program_ctx):
        converted.append(getattr(entity, "__qualname__", repr(entity)))
        return real(entity, program_ctx)

    monkeypatch.setattr(api, "_convert_actual", spy)
    lines = make_lines(24, max_words=8)
    for mode in ("sentence", "stream"):
        data = make_data(lines, mode=mode, bptt=3)
        next(iter(data.batches("train", training=True, batch_size=4)))
        next(iter(replica_batches(data, "valid", training=False, batch_size=4,
                                  input_context=Ctx(2, 1, 0))))
    assert converted == []
