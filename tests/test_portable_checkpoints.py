"""A checkpoint written under one synchronous strategy resumes under another (another
device count too) and ends where a run that never moved ends: every synchronous strategy
computes the one-device update, and checkpoints name tensors, not devices.
In stream mode the checkpoint carries the recurrent state in global form ([B, H] per
layer), so it moves too."""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from conftest import PINNED, REPO, assert_resumed_from, resumed_steps
from faults import checkpoint_tensors
from tfpar.tools.cli import train_main

STRATEGIES = {
    "default": ["--strategy", "default"],
    "mirrored:2": ["--strategy", "mirrored", "--cpu-devices", "2"],
    "tower:3": ["--strategy", "tower", "--cpu-devices", "3"],
    "pipeline": ["--strategy", "pipeline", "--cpu-devices", "2"],
    "parallel_do:2": ["--strategy", "parallel_do", "--cpu-devices", "2"],
}


def flags(corpus, model_dir, steps, mode):
    return ["--data", str(corpus), "--mode", mode, "--bptt", "8", *PINNED, "--layers", "2",
            "--embed-dim", "16", "--hidden-dim", "16", "--batch-size", "12", "--epochs", "5",
            "--max-steps", str(steps), "--no-progress", "--no-export", "--deterministic",
            "--seed", "5", "--model-dir", str(model_dir)]


def run(corpus, model_dir, strategy, steps, mode, capsys, resumes_from):
    """Trains ``model_dir`` to ``steps``; it must resume from step ``resumes_from`` (None:
    a fresh start), which equal final tensors alone would not show."""
    capsys.readouterr()
    assert train_main(flags(corpus, model_dir, steps, mode) + STRATEGIES[strategy]) == 0
    assert_resumed_from(capsys.readouterr().err, resumes_from)


def weights(model_dir):
    """Every checkpointed tensor: weights, slots, counters, RNG states, carried state."""
    return checkpoint_tensors(model_dir)


# The runs that never moved checkpoint every LEG steps, so a moved run can be compared
# with one at every step it changes strategy at; one per mode, as long as the longest run.
LEG, TAIL = 12, 50
LONGEST = {"sentence": LEG + TAIL, "stream": 2 * LEG + TAIL}


@pytest.fixture(scope="module")
def still(module_tiny_corpus, tmp_path_factory):
    """``still(mode, step)``: the tensors of a default run that never moved, at ``step``
    (a multiple of LEG, or LONGEST[mode]; one run per mode, cached)."""
    runs = {}

    def get(mode, step):
        if mode not in runs:
            model_dir = tmp_path_factory.mktemp(f"still-{mode}")
            every = ["--checkpoint-every", str(LEG), "--keep-checkpoints", "100"]
            assert train_main(flags(module_tiny_corpus, model_dir, LONGEST[mode], mode)
                              + STRATEGIES["default"] + every) == 0
            runs[mode] = model_dir
        return tensors_at(runs[mode], step)

    return get


def tensors_at(model_dir, step):
    """:func:`checkpoint_tensors` of ``model_dir``'s checkpoint of ``step``."""
    import tensorflow as tf

    from faults import BOOKKEEPING

    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints" / f"ckpt-{step}"))
    keys = sorted(k for k in reader.get_variable_to_shape_map() if not k.startswith(BOOKKEEPING))
    return {k: np.asarray(reader.get_tensor(k)) for k in keys}


# A chain of moves in one model dir: LEG steps under each strategy, then TAIL (50) steps
# under the last one, so every move is followed by at least 50 steps for a small
# difference to grow. Moves covered: sentence mirrored:2 -> parallel_do:2; stream
# pipeline -> mirrored:2 -> tower:3 (and the fault tool's matrix test: mirrored:2 ->
# tower:3 in stream mode). (One chain instead of one case per move: the moves are the
# same, the runs from scratch to the first move are shared.)
# Sentence mode's move (mirrored:2 -> parallel_do:2, killed mid-run) is
# test_faults.py::test_a_checkpoint_moved_between_strategies_matches_the_default_run.
@pytest.mark.parametrize("mode,chain", [
    ("stream", ["pipeline", "mirrored:2", "tower:3"]),
], ids=lambda value: "-".join(value) if isinstance(value, list) else value)
def test_a_checkpoint_moves_between_strategies(mode, chain, tiny_corpus_dir, still, tmp_path,
                                               capsys):
    steps = 0
    for i, strategy in enumerate(chain):
        before, steps = steps, steps + (TAIL if i == len(chain) - 1 else LEG)
        run(tiny_corpus_dir, tmp_path / "moved", strategy, steps, mode, capsys,
            resumes_from=before or None)
        want, got = still(mode, steps), weights(tmp_path / "moved")
        where = f"{' -> '.join(chain[:i + 1])} at step {steps}"
        assert got.keys() == want.keys() and any(k.startswith("moments/") for k in got), where
        assert int(got["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == steps, where
        assert worst_difference(got, want) <= 1e-5, where
    assert steps == LONGEST[mode]


def worst_difference(got, want) -> float:
    """Max |Δ| over the float tensors; counters and RNG states must be equal."""
    worst = 0.0
    for key in want:
        if got[key].dtype.kind == "f":
            # NaN (a tensor gone non-finite on one side) counts as infinitely far.
            # (equal values, infinities included, differ by 0)
            with np.errstate(invalid="ignore"):
                delta = np.where(got[key] == want[key], 0.0,
                                 np.nan_to_num(np.abs(got[key] - want[key]), nan=np.inf))
            worst = max(worst, float(delta.max()))
        else:
            assert (got[key] == want[key]).all(), key
    return worst


@pytest.mark.cluster
def test_a_checkpoint_moves_into_and_out_of_a_multi_worker_job(tiny_corpus_dir, still,
                                                               tmp_path, capsys):
    """Stream mode: 12 steps under mirrored:2, to 24 as two worker processes (each holds
    its replica's rows of the carried state), to 74 under default; against 74 straight."""
    import subprocess
    import sys

    from conftest import REPO

    run(tiny_corpus_dir, tmp_path / "moved", "mirrored:2", 12, "stream", capsys, None)
    job = subprocess.run(
        [sys.executable, f"{REPO}/scripts/launch_local.py", "--workers", "2", "--",
         "--strategy", "multi_worker", *flags(tiny_corpus_dir, tmp_path / "moved", 24, "stream")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stdout[-3000:]
    resumed = resumed_steps(job.stdout)  # each worker restores
    assert resumed and set(resumed) == {12}, resumed
    assert int(weights(tmp_path / "moved")["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) \
        == 24
    run(tiny_corpus_dir, tmp_path / "moved", "default", 74, "stream", capsys, 24)
    want, got = still("stream", 74), weights(tmp_path / "moved")  # 74 == LONGEST["stream"]
    assert got.keys() == want.keys()
    assert worst_difference(got, want) <= 1e-5


def test_every_weight_is_stored_once(tmp_path):
    """The checkpoint reaches each weight by two paths ("layers/<path>" and Keras'
    "model/..." tracking); TensorFlow writes a variable reachable several ways once, under
    the first path: no key names a model weight twice, and the data file holds each
    variable's bytes once (a file twice the size would mean a second copy)."""
    import contextlib

    import keras

    from conftest import model_config
    from tfpar.training.state import build_train_state

    state = build_train_state(contextlib.nullcontext(), model_config(embed_dim=8, hidden_dim=8),
                              50, seed=0,
                              make_optimizer=lambda epoch, scale: keras.optimizers.Adam())
    path = tf.train.Checkpoint(**state.trackables()).write(str(tmp_path / "ckpt"))
    keys = [name for name, _ in tf.train.list_variables(path)]
    weights = [k for k in keys if k.startswith("layers/")]
    assert len(weights) == len(state.model.weights)
    assert not [k for k in keys if k.startswith("model/") and "VARIABLE_VALUE" in k]
    stored = sum(np.asarray(v).nbytes for v in state.variables())
    graph = len(tf.train.load_checkpoint(path).get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    data = sum(f.stat().st_size for f in tmp_path.glob("ckpt.data-*"))
    assert stored <= data - graph < stored + 256  # + the selection's scalars


# A run's model dir as an earlier tfpar wrote it (at commit 83a689a, 2026-12-05), its
# training events left out: tfpar-train with these flags, then --max-steps 3 --model-dir
# DIR --final-weights last. 3 steps of a 1x8 tied LSTM on a 16-word synthetic corpus in
# stream mode, with Adam: model weights, Adam's slots, the counters, the model selection
# and the carried stream state, 44 KB. Its valid perplexity, from that run's metrics.
EARLIER_RUN = os.path.join(REPO, "tests", "data", "model_dir_2026_12_05")
EARLIER_FLAGS = ["--data", "synthetic", "--synthetic-sentences", "60,10,10", "--vocab-size",
                 "16", "--mode", "stream", "--bptt", "5", "--layers", "1", "--embed-dim", "8",
                 "--hidden-dim", "8", "--optimizer", "adam", "--lr", "3e-3", "--batch-size",
                 "4", "--no-export", "--no-progress", "--seed", "3", "--final-weights", "last"]
EARLIER_VALID_PPL = 15.740412901903046


def test_a_model_dir_written_by_an_earlier_version_scores_and_resumes(tmp_path, capsys):
    """Today's code reads an earlier version's checkpoint by its tensors' names: the
    weights score the valid split as they did when it was written, and training resumes
    from its step 3 (every weight, slot, counter and carried state found, or the restore
    refuses it) and goes on to step 5."""
    from tfpar.tools import evaluate

    run_dir = tmp_path / "run"
    shutil.copytree(EARLIER_RUN, run_dir)
    assert evaluate.main(["--model-dir", str(run_dir), "--split", "valid", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"] == pytest.approx(EARLIER_VALID_PPL, rel=1e-5)
    assert train_main(EARLIER_FLAGS + ["--max-steps", "5", "--model-dir", str(run_dir)]) == 0
    assert_resumed_from(capsys.readouterr().err, 3)
    assert tf.train.latest_checkpoint(str(run_dir / "checkpoints")).endswith("ckpt-5")
