"""A non-finite step changes nothing, under every strategy; --on-nan skip goes on and
--on-nan stop stops with the last good weights checkpointed.

In process, per synchronous strategy (and the parameter-server step with partitioned
variables): one good Adam step (so the slots are non-zero), then the weights are poisoned
so that one batch, whose poisoned rows sit on the last replica only, has a non-finite
gradient: a NaN embedding row of a token only that batch reads (loss and gradient NaN),
or a softmax column that makes the gradient's global norm overflow while the loss stays
finite (norm inf). Every model variable, optimizer slot and the step counter must stay
bit-identical; the next good step must change them all (so the comparison can fail).

Also in process: stream mode (the carried state), the loop restarting the state after
a bad window, sampling from a diverged model, and a batch
whose loss is infinite but whose gradient is finite.

End to end (the CLI, then real clusters via scripts/launch_local.py):
``--optimizer adam --lr 1e38 --clip-norm 0`` sends the weights to ~1e38 in step 1, so
every later gradient is NaN. The checkpoint written after those batches (at the
--on-nan stop, or at the epoch end under skip; no --checkpoint-every, so step 1 was not
saved before them) must equal, bit for bit, a ``--max-steps 1`` run's.
"""

import contextlib
import json
import math
import os
import subprocess
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import (PINNED, REPO, batch_of, hand_built_loop, model_config, small_config,
                      snapshot, train_config)
from tfpar.config import DataConfig, DistConfig, RunConfig
from tfpar.data.pipeline import InputData
from tfpar.parallel.rows import per_replica
from tfpar.data.vocab import EOS_ID, Vocab
from tfpar.errors import TrainingError
from tfpar.model.lm import build_model
from tfpar.parallel.registry import build_strategy
from tfpar.parallel import parameter_server as ps
from tfpar.serving import sample
from tfpar.tools.cli import train_main
from tfpar.training.loop import count_batches
from tfpar.training.state import build_train_state, named_weights
from tfpar.objective.step import make_train_step

MODEL = model_config(embed_dim=8, hidden_dim=8)
VOCAB = 20
P = 19  # its embedding row becomes NaN: a batch reading it has a NaN loss and gradient
Q = 18  # its softmax column becomes huge: a batch predicting it has an infinite norm
CLIP = 5.0
CPU = tuple(f"/device:CPU:{i}" for i in range(4))
TWO_STAGES = "embedding=/cpu:0,rnn=/cpu:1,softmax=/cpu:1"

# 6 rows of 5 targets: 2 replicas get 3 rows each, 3 replicas 2 each; the poisoned token
# sits in the last row only, so only the last replica (micro-batch) sees it.
GOOD = [[3, 4, 5, 6, 2], [7, 8, 9, 10, 2], [11, 12, 13, 14, 2], [15, 16, 17, 3, 2],
        [4, 6, 8, 10, 2], [12, 14, 16, 5, 2]]
GOOD_2 = [row[::-1] for row in GOOD]  # the next good batch
NAN_ROWS = GOOD[:5] + [[12, P, 16, 5, 2]]  # P is read as an input (after the target)
INF_ROWS = GOOD[:5] + [[12, 14, Q, 5, 2]]  # Q is a target exactly once

SYNC = {
    "default": DistConfig(),
    "one_device": DistConfig(strategy="one_device", devices=(CPU[1],)),
    "mirrored:2": DistConfig(strategy="mirrored", devices=CPU[:2]),
    "tower:2-controller": DistConfig(strategy="tower", devices=CPU[:2], tower_reduce="controller"),
    "tower:2-ring": DistConfig(strategy="tower", devices=CPU[:2], tower_reduce="ring"),
    "tower:3-controller": DistConfig(strategy="tower", devices=CPU[:3], tower_reduce="controller"),
    "tower:3-ring": DistConfig(strategy="tower", devices=CPU[:3], tower_reduce="ring"),
    "pipeline:2": DistConfig(strategy="pipeline", stages=TWO_STAGES, micro_batches=2),
    "parallel_do:2": DistConfig(strategy="parallel_do", devices=CPU[:2]),
}


# ----------------------------------------------------------------------------- helpers
def adam(epoch, lr_scale):
    return keras.optimizers.Adam(0.01)


def distributed(plugin, rows):
    """The batch of ``rows`` in the form ``plugin``'s step takes (per replica for
    tf.distribute strategies, the global batch for the others)."""
    ds = tf.data.Dataset.from_tensors(batch_of(rows))
    return next(iter(plugin.distribute(lambda ctx: per_replica(ds, ctx))))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def changed(state, before) -> list[str]:
    """Paths of the state's variables that differ from the snapshot ``before``."""
    return [v.path for v, a, b in zip(state.variables(), before, snapshot(state))
            if not same(a, b)]


def slot_variables(state) -> list:
    return [v for v in state.optimizer.variables
            if v.path.split("/")[-1] not in ("iteration", "learning_rate")]


def non_finite(x) -> bool:
    return not math.isfinite(float(x))


@contextlib.contextmanager
def poisoned(state, kind: str):
    """Weights that make the ``kind`` batch non-finite; restored on exit."""
    weights = named_weights(state.model)
    if kind == "nan":
        new = {"embedding:embeddings": lambda w: w.__setitem__(P, np.nan)}
    else:  # the norm overflows (gradient ~1e25 per element), the loss stays ~1e38
        new = {"softmax:kernel": lambda w: w.__setitem__((slice(None), Q), 1e25),
               "softmax:bias": lambda w: w.__setitem__(Q, -1e38)}
    saved = {name: weights[name].numpy() for name in new}
    for name, edit in new.items():
        value = saved[name].copy()
        edit(value)
        weights[name].assign(value)
    try:
        yield
    finally:
        for name, value in saved.items():
            weights[name].assign(value)


def check_a_good_step(out, state, before, iterations):
    """The step was finite and applied: the step count moved and every weight and slot
    changed (so a non-finite step that changed anything would be seen)."""
    assert math.isfinite(float(out.nll_sum)) and math.isfinite(float(out.grad_norm))
    assert bool(out.applied) and not bool(out.scale_skipped)  # what the loop counts by
    assert int(state.optimizer.iterations.numpy()) == iterations
    moved = set(changed(state, before))
    for v in list(state.model.trainable_variables) + slot_variables(state):
        assert v.path in moved, f"{v.path} did not change in a good step"


def check_non_finite_steps(state, run, stream_state=None):
    """Both poisons: the step reports a non-finite norm and changes nothing."""
    for kind, rows in (("nan", NAN_ROWS), ("inf", INF_ROWS)):
        iterations = int(state.optimizer.iterations.numpy())
        with poisoned(state, kind):
            before = snapshot(state)
            out = run(rows, stream_state)
            assert non_finite(out.grad_norm), (kind, float(out.grad_norm))
            assert not bool(out.applied) and not bool(out.scale_skipped)
            if kind == "inf":  # only the gradient is bad: the guard is on its norm
                assert math.isfinite(float(out.nll_sum)), float(out.nll_sum)
            assert changed(state, before) == [], f"{kind}: a skipped step changed these"
            assert int(state.optimizer.iterations.numpy()) == iterations


# ----------------------------------------------------------------------------- in process
@pytest.mark.parametrize("name", list(SYNC))
def test_a_non_finite_gradient_changes_no_weight_slot_or_counter(name):
    plugin = build_strategy(SYNC[name])
    state = build_train_state(plugin.scope(), MODEL, VOCAB, seed=0, make_optimizer=adam)
    step = make_train_step(plugin, state.model, state.optimizer, clip_norm=CLIP)

    def run(rows, _state=None):
        return step(distributed(plugin, rows))

    before = snapshot(state)
    check_a_good_step(run(GOOD), state, before, iterations=1)
    assert all(np.any(v.numpy() != 0) for v in slot_variables(state))  # Adam's slots live
    check_non_finite_steps(state, run)
    before = snapshot(state)
    check_a_good_step(run(GOOD_2), state, before, iterations=2)  # training goes on


@pytest.mark.parametrize("name", ["mirrored:2", "tower:3-ring", "pipeline:2"])
def test_stream_mode_a_non_finite_window_changes_nothing(name):
    """The state carried into the bad window is the last good window's; the next good
    window starts from that same state and is applied."""
    plugin = build_strategy(SYNC[name])
    state = build_train_state(plugin.scope(), MODEL, VOCAB, seed=0, make_optimizer=adam)
    step = make_train_step(plugin, state.model, state.optimizer, clip_norm=CLIP)

    def run(rows, carried):
        return step(distributed(plugin, rows), carried)

    before = snapshot(state)
    first = run(GOOD, None)
    check_a_good_step(first, state, before, iterations=1)
    assert first.state is not None
    check_non_finite_steps(state, run, first.state)
    before = snapshot(state)
    check_a_good_step(run(GOOD_2, first.state), state, before, iterations=2)
    # Why the loop restarts the state after a non-finite window
    # (test_stream_mode_skip_drops_only_the_bad_window): a NaN window ends in a NaN state.
    with poisoned(state, "nan"):
        nan_state = run(NAN_ROWS, first.state).state
    assert not all(np.isfinite(t.numpy()).all()
                   for t in tf.nest.flatten(nan_state, expand_composites=True))


class InlineCoordinator:
    """Stands in for ClusterCoordinator: runs a scheduled step at once, here."""

    def schedule(self, fn, args):
        result = fn(*args)
        return types.SimpleNamespace(fetch=lambda: result)

    def join(self):
        pass


def test_parameter_server_step_with_partitioned_variables_changes_nothing():
    """The worker's step of asynchronous training (its own update, per shard, and an
    atomic step count), with the tables split in two as on two ps tasks."""
    from test_parameter_server import sharded_scope

    coordinator = ps.Coordinator(tf.distribute.get_strategy(), InlineCoordinator(),
                                 types.SimpleNamespace(count=lambda job: 2))
    state = build_train_state(sharded_scope(), MODEL, VOCAB, seed=0, make_optimizer=adam)
    emb = named_weights(state.model)["embedding:embeddings"]
    assert len(ps.shard_parts(emb)) == 2  # the poisoned table is really partitioned
    schedule = coordinator.make_schedule_step(state.model, state.optimizer, clip_norm=CLIP)

    def run(rows, _state=None):
        iterator = iter(tf.data.Dataset.from_tensors(batch_of(rows)))
        return coordinator.fetch(schedule(iterator))

    before = snapshot(state)
    check_a_good_step(run(GOOD), state, before, iterations=1)
    check_non_finite_steps(state, run)
    before = snapshot(state)
    check_a_good_step(run(GOOD_2), state, before, iterations=2)


@pytest.mark.parametrize("name", ["default", "mirrored:2"])
def test_an_infinite_loss_with_a_finite_gradient_is_not_applied(name):
    plugin = build_strategy(SYNC[name])
    state = build_train_state(plugin.scope(), MODEL, VOCAB, seed=0, make_optimizer=adam)
    step = make_train_step(plugin, state.model, state.optimizer, clip_norm=CLIP)
    step(distributed(plugin, GOOD))
    bias = named_weights(state.model)["softmax:bias"]
    value = bias.numpy()
    value[Q] = -3e38  # each Q target costs 3e38 nats: two of them overflow the sum
    bias.assign(value)
    before = snapshot(state)
    out = step(distributed(plugin, GOOD[:5] + [[12, Q, Q, 5, 2]]))
    assert float(out.nll_sum) == float("inf")
    assert math.isfinite(float(out.grad_norm))  # softmax - one-hot: finite
    # The step says so, and Loop.record then says "non-finite loss ... the update was
    # not applied".
    assert not bool(out.applied) and not bool(out.scale_skipped)
    assert changed(state, before) == []


def stream_setup(tmp_path):
    """A stream-mode loop on one device whose train split reads the word ``zz`` (NaN
    embedding row) exactly once, in the middle."""
    rng = np.random.default_rng(0)
    lines = [" ".join(f"w{int(i)}" for i in rng.integers(0, 12, size=6)) for _ in range(40)]
    lines[20] = "w1 w2 zz w3 w4"
    vocab = Vocab.build(lines)
    config = small_config(data=DataConfig(mode="stream", bptt=4),
                    model=MODEL,
                    train=train_config(batch_size=4, on_nan="skip", epochs=1, clip_norm=CLIP,
                                       steps_per_execution=1),
                    run=RunConfig(model_dir=str(tmp_path), progress=False))
    data = InputData({"train": lines, "valid": lines[:4], "test": lines[:4]}, vocab,
                     config.data, seed=0)
    plugin = build_strategy(DistConfig())
    state = build_train_state(plugin.scope(), MODEL, len(vocab), seed=0, make_optimizer=adam,
                              fixed_shapes=True, carry_rows=4)
    loop = hand_built_loop(config, plugin, data, state, tmp_path, clip_norm=CLIP,
                           poison="zz")
    windows = count_batches(data.batches("train", training=True, batch_size=4))
    return loop, state, windows


def test_stream_mode_skip_drops_only_the_bad_window(tmp_path):
    """--on-nan skip in stream mode: the window reading ``zz`` is skipped and the next one
    starts from a fresh state; carried on, its NaN state would make every later window
    of the epoch non-finite (all of them skipped)."""
    loop, state, windows = stream_setup(tmp_path)
    assert windows >= 10
    loop.train_epoch(0, 0)
    assert loop.progress.skipped == 1
    assert state.step == windows - 1
    assert int(state.batch_in_epoch.numpy()) == windows


def test_stream_mode_stop_checkpoints_the_position_and_state_of_the_bad_window(tmp_path):
    """--on-nan stop in stream mode: the checkpoint records the bad window's position and
    the (finite, non-zero) state it started from, so a resumed run retries that window
    exactly; not the NaN state it ended in, nor zeros."""
    loop, state, windows = stream_setup(tmp_path)
    loop.non_finite.on_nan = "stop"  # the policy's --on-nan
    with pytest.raises(TrainingError, match="the update was not applied"):
        loop.train_epoch(0, 0)
    bad = state.step  # windows 0 .. bad-1 were applied
    assert 0 < bad < windows - 1
    reader = tf.train.load_checkpoint(os.path.join(str(tmp_path), "checkpoints"))
    assert int(reader.get_tensor("batch_in_epoch/.ATTRIBUTES/VARIABLE_VALUE")) == bad
    carry = [reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
             if k.startswith("carry/")]
    assert carry and all(np.isfinite(c).all() for c in carry)
    assert any(np.abs(c).max() > 0 for c in carry)


def test_sampling_a_diverged_model_ends_rows_instead_of_failing():
    """Non-finite scores: the draw would return an id outside the vocabulary (then the
    embedding lookup fails: 'indices[0,0] = V is not in [0, V)') and argmax <pad>."""
    logits = tf.constant([[0.0, 0.0, 1.0, 2.0, 3.0], [np.nan] * 5, [1.0, 2.0, np.inf, 3.0, 4.0],
                          [-np.inf] * 5], tf.float32)
    for temperature, top_k in ((1.0, 0), (1.0, 3), (0.0, 0)):
        tokens = sample.choose_tokens(logits, tf.constant(0), temperature=tf.constant(temperature),
                                      top_k=tf.constant(top_k), seed=tf.constant(1)).numpy()
        assert tokens[0] in (2, 3, 4)  # a finite row is untouched (<pad>/<unk> never)
        assert list(tokens[1:]) == [EOS_ID] * 3, (temperature, top_k, tokens)

    lines = ["w1 w2 w3", "w2 w3 w4"]
    vocab = Vocab.build(lines)
    model = build_model(MODEL, len(vocab), seed=0)
    model.set_weights([np.full_like(w, np.nan) for w in model.get_weights()])
    sampler = sample.Sampler(model, vocab)
    assert sampler(["", "w1"], max_tokens=5, temperature=1.0, seed=3) == ["", ""]
    assert sampler(["w2"], max_tokens=5, temperature=0.0) == [""]


# ----------------------------------------------------------------------------- the CLI
# --nan-patience 0: skip never gives up (test_skip_gives_up_after_nan_patience_batches)
DIVERGE = ["--optimizer", "adam", "--lr", "1e38", "--clip-norm", "0", "--nan-patience", "0"]
# Bookkeeping, not training state: the counters, and the epoch-end model selection (a
# NaN valid perplexity counts as an epoch without improvement).
COUNTERS = ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter", "epoch", "batch_in_epoch",
            "selection")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """train/valid/test splits of 300/40/40 varied sentences (27 batches of 16)."""
    path = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    for split, n in (("train", 300), ("valid", 40), ("test", 40)):
        lines = [" ".join(rng.choice(words, size=int(rng.integers(1, 25)))) for _ in range(n)]
        (path / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_args(corpus, out, *extra):
    return ["--data", str(corpus), *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
            "--batch-size", "16", "--epochs", "1", "--no-progress", "--seed", "3",
            "--model-dir", str(out / "run"), "--export-dir", str(out / "export"),
            "--metrics-json", str(out / "metrics.json"), *DIVERGE, *extra]


def batches_per_epoch(corpus, pipelines: int = 1) -> int:
    """Steps of an epoch; with several input pipelines (multi_worker) each reads its own
    lines, and the epoch lasts as long as the longest's (verify's shared_batches)."""
    from tfpar.data.sources import load_corpus
    from tfpar.tools.verify import shared_batches

    config = DataConfig(source=str(corpus))
    loaded = load_corpus(config, seed=3)
    data = InputData(loaded.splits, Vocab.build(loaded.splits["train"]), config, seed=3)
    return count_batches(shared_batches(data, "train", 16, pipelines, shuffle=True))


def checkpoint_tensors(model_dir) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(os.path.join(str(model_dir), "checkpoints"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.split("/")[0] not in COUNTERS}


def check_checkpoint_is_step_1(model_dir, reference):
    """The latest checkpoint of ``model_dir`` holds exactly the state after step 1."""
    got = checkpoint_tensors(model_dir)
    assert sorted(got) == sorted(reference)
    assert any(k.startswith("moments/") for k in got)
    assert [k for k in got if not same(got[k], reference[k])] == []
    assert int(got["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 1
    weights = [v for k, v in got.items() if k.startswith("layers/")]
    assert all(np.isfinite(w).all() for w in weights)
    assert max(float(np.abs(w).max()) for w in weights) > 1e37  # step 1 applied lr 1e38


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The checkpoint tensors of a one-step run (the last good state of every run here)."""
    out = tmp_path_factory.mktemp("reference")
    assert train_main(run_args(corpus, out, "--max-steps", "1", "--no-export")) == 0
    return checkpoint_tensors(out / "run")


def test_on_nan_stop_exits_with_one_line_and_the_last_good_weights(corpus, reference, tmp_path,
                                                                   capsys):
    code = train_main(run_args(corpus, tmp_path, "--max-steps", "5", "--on-nan", "stop"))
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: non-finite loss or gradient in the batch after step 1 "
                           "(loss nan, gradient norm nan); the update was not applied and "
                           "the weights of step 1 are checkpointed in ")
    assert [line for line in err.splitlines() if line.startswith("error:")] == [last]
    check_checkpoint_is_step_1(tmp_path / "run", reference)
    assert batch_in_epoch(tmp_path / "run") == 1  # a resumed run tries the bad batch again


def batch_in_epoch(model_dir) -> int:
    reader = tf.train.load_checkpoint(os.path.join(str(model_dir), "checkpoints"))
    return int(reader.get_tensor("batch_in_epoch/.ATTRIBUTES/VARIABLE_VALUE"))


def test_skip_gives_up_after_nan_patience_batches(corpus, reference, tmp_path, capsys):
    """--on-nan skip with --nan-patience 3: three bad batches in a row, then a one-line
    error (exit 2) and the last good weights checkpointed."""
    args = run_args(corpus, tmp_path, "--max-steps", "5", "--on-nan", "skip")
    args[args.index("--nan-patience") + 1] = "3"
    code = train_main(args)
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert len([l for l in err.splitlines() if l.endswith("skipped (--on-nan skip)")]) == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: 3 non-finite batches in a row after step 1 "
                           "(--nan-patience 3): giving up; the weights of step 1 are "
                           "checkpointed in ")
    assert [line for line in err.splitlines() if line.startswith("error:")] == [last]
    check_checkpoint_is_step_1(tmp_path / "run", reference)
    assert batch_in_epoch(tmp_path / "run") == 1  # from the first of the three bad batches


def test_a_data_parallel_run_that_diverges_ends_with_one_line(corpus, tmp_path, capsys):
    """The diverging run under mirrored:2, --on-nan stop and --on-nan skip (--nan-patience
    3): exit 2, one error line, no traceback, a checkpoint of step 1 whose weights are all
    finite (the lr 1e38 update of step 1 was the last one applied). Every synchronous
    strategy runs the one training loop that decides this; what a strategy's own step
    does with a non-finite batch (nothing applied) is
    test_a_non_finite_gradient_changes_no_weight_slot_or_counter's, per strategy."""
    strategy = ["--strategy", "mirrored", "--cpu-devices", "2"]
    for on_nan, patience in (("stop", "0"), ("skip", "3")):
        out = tmp_path / on_nan
        args = run_args(corpus, out, "--max-steps", "5", "--no-export", "--on-nan", on_nan,
                        *strategy)
        args[args.index("--nan-patience") + 1] = patience
        code = train_main(args)
        err = capsys.readouterr().err
        assert code == 2, err[-2000:]
        assert "Traceback" not in err
        assert [line for line in err.splitlines() if line.startswith("error:")] == \
            [err.strip().splitlines()[-1]]
        assert "the weights of step 1 are checkpointed in" in err
        got = checkpoint_tensors(out / "run")
        assert int(got["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 1
        weights = [v for k, v in got.items() if k.startswith("layers/")]
        assert weights and all(np.isfinite(w).all() for w in weights)


def test_on_nan_skip_goes_on_to_the_end(corpus, reference, tmp_path, capsys):
    """Every batch after step 1 is skipped; the run evaluates, exports and writes its
    metrics (NaN perplexities) without a traceback; the epoch-end checkpoint, written
    after all the skipped batches, is still step 1's state."""
    code = train_main(run_args(corpus, tmp_path, "--max-steps", "4", "--on-nan", "skip",
                               "--epoch-inspection"))
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "error:" not in err
    batches = batches_per_epoch(corpus)
    skipped = [line for line in err.splitlines() if line.endswith("skipped (--on-nan skip)")]
    assert len(skipped) == batches - 1
    assert all("in the batch after step 1 (loss nan, gradient norm nan)" in s for s in skipped)
    assert "the weights have diverged): no text samples this epoch" in err
    metrics = json.loads((tmp_path / "metrics.json").read_text())  # NaN is written as null
    assert (metrics["steps"], metrics["skipped_batches"]) == (1, batches - 1)
    for split in ("valid_ppl", "test_ppl"):
        assert metrics[split] is None
    assert os.path.exists(os.path.join(metrics["export_path"], "saved_model.pb"))
    check_checkpoint_is_step_1(tmp_path / "run", reference)


# ----------------------------------------------------------------------------- clusters
LAUNCH = os.path.join(REPO, "scripts", "launch_local.py")


def launch(launcher_args, train_args, cwd):
    """A local cluster (``scripts/launch_local.py``), started without waiting."""
    return subprocess.Popen([sys.executable, LAUNCH, *launcher_args, "--", *train_args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc, timeout=300) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


def run_cluster_pair(corpus, tmp_path, launcher_args, strategy):
    """A one-step reference job and a --on-nan skip job of the same cluster, side by side
    (each waits for gRPC most of the time)."""
    common = ["--strategy", strategy, "--no-export", "--eval-batch-size", "40"]
    ref = launch(launcher_args, run_args(corpus, tmp_path / "ref", *common, "--max-steps", "1"),
                 tmp_path)
    skip = launch(launcher_args, run_args(corpus, tmp_path / "skip", *common, "--max-steps", "4",
                                          "--on-nan", "skip"), tmp_path)
    (ref_code, ref_log), (code, log) = finish(ref), finish(skip)
    assert ref_code == 0, ref_log[-3000:]
    assert code == 0, log[-3000:]
    assert "Traceback" not in log
    return checkpoint_tensors(tmp_path / "ref" / "run"), log


@pytest.mark.cluster
def test_multi_worker_skip_keeps_step_1_state(corpus, tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "skip").mkdir()
    reference, log = run_cluster_pair(corpus, tmp_path, ["--workers", "2"], "multi_worker")
    batches = batches_per_epoch(corpus, pipelines=2)
    for worker in (0, 1):  # both workers saw the same all-reduced norm and skipped
        skipped = [line for line in log.splitlines()
                   if line.startswith(f"[worker {worker}] ") and "skipped (--on-nan skip)" in line]
        assert len(skipped) == batches - 1
    metrics = json.loads((tmp_path / "skip" / "metrics.json").read_text())
    assert (metrics["replicas"], metrics["steps"], metrics["skipped_batches"]) == \
        (2, 1, batches - 1)
    check_checkpoint_is_step_1(tmp_path / "skip" / "run", reference)


@pytest.mark.cluster
def test_parameter_server_skip_keeps_step_1_state(corpus, tmp_path):
    """One worker (its steps run one after another, so the job is deterministic), one ps.
    --max-steps 4 is never reached: skipped steps are not updates, so the whole epoch is
    scheduled, as in the synchronous loop."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "skip").mkdir()
    reference, log = run_cluster_pair(corpus, tmp_path, ["--workers", "1", "--ps", "1"],
                                      "parameter_server")
    batches = batches_per_epoch(corpus)
    skipped = [line for line in log.splitlines()
               if line.startswith("[chief 0] ") and "skipped (--on-nan skip)" in line]
    assert len(skipped) == batches - 1
    metrics = json.loads((tmp_path / "skip" / "metrics.json").read_text())
    assert (metrics["strategy"], metrics["steps"], metrics["skipped_batches"]) == \
        ("parameter_server", 1, batches - 1)
    check_checkpoint_is_step_1(tmp_path / "skip" / "run", reference)
