"""--steps-per-execution N: N training steps per tf.function call, the same training."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tfpar.tools.cli import train_main
from test_summaries import read_events
from conftest import PINNED, REPO, assert_resumed_from, small_config, train_config
from faults import checkpoint_tensors

STRATEGIES = {
    "default": [],
    "mirrored": ["--strategy", "mirrored", "--cpu-devices", "2"],
    "tower": ["--strategy", "tower", "--cpu-devices", "3"],
    "pipeline": ["--strategy", "pipeline", "--cpu-devices", "2", "--layers", "2"],
}


def run(corpus, out, *extra, process: bool = False):
    """A --deterministic run on the tiny corpus (19 batches of 16 an epoch, so 20 steps
    cross an epoch end); exit status 0 asserted. ``process``: as its own ``train.py``
    process, as a user runs it (its stderr is printed for capsys)."""
    args = ["--data", str(corpus), *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
            "--batch-size", "16", "--epochs", "3", "--no-progress", "--deterministic",
            "--dropout", "0.2", "--no-export", "--log-every", "3",
            "--model-dir", str(out), *extra]
    if process:
        done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "train.py"),
                               *args], capture_output=True, text=True, timeout=600)
        print(done.stderr, file=sys.stderr)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        assert train_main(args) == 0
    return checkpoint_tensors(out)


def assert_equal_tensors(got, want):
    assert sorted(got) == sorted(want)
    assert [k for k in want if not np.array_equal(got[k], want[k])] == []


def train_losses(model_dir):
    return [(step, float(v)) for step, v, _ in read_events(model_dir / "train")["loss"]]


# Each mode under default or a strategy that carries stream state (one case per pair
# would repeat the same calls: the multi-step loop is one function for every strategy).
@pytest.mark.parametrize("strategy,mode", [
    ("default", "sentence"), ("mirrored", "stream"), ("tower", "sentence"),
    ("pipeline", "stream")])
def test_ten_steps_per_call_train_exactly_what_one_per_call_does(
        strategy, mode, module_tiny_corpus, tmp_path):
    """20 steps (an epoch end inside a call, checkpoints every 7 steps cutting calls,
    dropout on): every checkpointed tensor bit for bit, and the per-step train loss
    summaries at the same steps with the same values."""
    extra = [*STRATEGIES[strategy], "--mode", mode, "--bptt", "6", "--max-steps", "20",
             "--checkpoint-every", "7"]
    one = run(module_tiny_corpus, tmp_path / "one", *extra)
    ten = run(module_tiny_corpus, tmp_path / "ten", *extra, "--steps-per-execution", "10")
    assert int(ten["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 20
    assert_equal_tensors(ten, one)
    assert train_losses(tmp_path / "ten") == train_losses(tmp_path / "one")
    assert [s for s, _ in train_losses(tmp_path / "one")][:3] == [1, 3, 6]


@pytest.mark.parametrize("mode", ["sentence", "stream"])
def test_a_run_resumed_with_several_steps_per_call_ends_like_an_uninterrupted_one(
        mode, module_tiny_corpus, tmp_path, capsys):
    """9 steps, then on to 25 (mid-epoch resume), 4 steps per call, against 25 straight
    with one per call; each run its own process, as a stopped and restarted run is.

    Run in one process after other tests, the stream case has differed from the straight
    run in the last float bits of some tensors: which kernels a traced step gets can
    depend on what the process compiled before (tfpar.model.lm, ``embed``)."""
    extra = ["--mode", mode, "--bptt", "6", "--checkpoint-every", "0"]
    want = run(module_tiny_corpus, tmp_path / "straight", *extra, "--max-steps", "25",
               process=True)
    run(module_tiny_corpus, tmp_path / "resumed", *extra, "--max-steps", "9",
        "--steps-per-execution", "4", process=True)
    capsys.readouterr()
    got = run(module_tiny_corpus, tmp_path / "resumed", *extra, "--max-steps", "25",
              "--steps-per-execution", "4", process=True)
    assert_resumed_from(capsys.readouterr().err, 9)  # not 25 steps from scratch
    assert_equal_tensors(got, want)


def test_a_diverging_run_stops_at_its_first_bad_step_inside_a_call(module_tiny_corpus,
                                                                     tmp_path, capsys):
    """lr 1e38 makes step 2 non-finite in the middle of a 5-step call: the same one-line
    error as with one step per call, step 1's weights checkpointed, and the input
    position at the bad batch (no later batch of the call consumed)."""
    args = ["--data", str(module_tiny_corpus), *PINNED,
            "--embed-dim", "16", "--hidden-dim", "16",
            "--batch-size", "16", "--no-progress", "--no-export", "--optimizer", "adam",
            "--lr", "1e38", "--clip-norm", "0", "--max-steps", "5",
            "--model-dir", str(tmp_path / "run"), "--steps-per-execution", "5"]
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "error: non-finite loss or gradient in the batch after step 1 ")
    got = checkpoint_tensors(tmp_path / "run")
    assert int(got["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 1
    assert int(got["batch_in_epoch/.ATTRIBUTES/VARIABLE_VALUE"]) == 1


def test_a_non_positive_steps_per_execution_is_one_line(tmp_path, capsys):
    # (Under parameter_server it is refused too: tests/test_parameter_server.py.)
    args = ["--steps-per-execution", "0", "--model-dir", str(tmp_path / "run"),
            "--no-progress"]
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "error: steps-per-execution must be > 0, got 0"
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_the_default_is_one_step_per_call_on_cpus_and_more_on_gpus():
    """--steps-per-execution unset: 1 where the strategy trains on CPUs, the GPU default
    where it computes on GPUs (device lists patched); a value given is kept; the
    asynchronous coordinator keeps 1 (it schedules steps one by one)."""
    import types

    from tfpar.config import DistConfig
    from tfpar.training import run

    def resolved(devices, strategy="mirrored", given=None):
        config = small_config(dist=DistConfig(strategy=strategy),
                        train=train_config(steps_per_execution=given))
        plugin = types.SimpleNamespace(devices=devices, cluster_resolver=None)
        return run.steps_per_execution(config, plugin).train.steps_per_execution

    gpus = ["/job:localhost/replica:0/task:0/device:GPU:0", "/device:GPU:1"]
    assert resolved(["/device:CPU:0", "/device:CPU:1"]) == 1
    assert resolved(gpus) == run.GPU_STEPS_PER_EXECUTION > 1
    assert resolved(gpus[:1]) == run.GPU_STEPS_PER_EXECUTION
    assert resolved(gpus, given=1) == 1
    # A pipeline on GPUs with its embedding on the host CPU.
    assert resolved(["/device:CPU:0"] + gpus) == run.GPU_STEPS_PER_EXECUTION
    assert resolved(gpus, strategy="parameter_server") == 1


def test_worker_processes_with_the_sampled_softmax_take_one_step_per_call():
    """Synchronous worker processes (a plug-in with a cluster resolver) and --softmax
    sampled: one step per call even on GPUs, and more asked for is a one-line error.
    (Two worker processes given ten sampled-softmax steps in one call failed in
    TensorFlow's all-gather of their sparse gradients, whose sizes differ: verify's
    multi_worker check, test_multi_worker.py, before it took one step per call.)"""
    import types

    from conftest import model_config
    from tfpar.config import DistConfig
    from tfpar.errors import ConfigError
    from tfpar.training import run

    gpus = types.SimpleNamespace(devices=["/job:worker/replica:0/task:0/device:GPU:0"],
                                 cluster_resolver=object())

    def config(softmax, given=None):
        return small_config(model=model_config(softmax=softmax),
                            dist=DistConfig(strategy="multi_worker"),
                            train=train_config(steps_per_execution=given))

    def resolved(c):
        return run.steps_per_execution(c, gpus).train.steps_per_execution

    assert resolved(config("sampled")) == 1
    assert resolved(config("sampled", given=1)) == 1
    assert resolved(config("full")) == run.GPU_STEPS_PER_EXECUTION  # the full softmax: fine
    assert resolved(config("full", given=4)) == 4
    with pytest.raises(ConfigError) as e:
        resolved(config("sampled", given=4))
    assert str(e.value) == (
        "--steps-per-execution 4 with --softmax sampled across worker processes: "
        "TensorFlow cannot gather the workers' sampled-softmax gradients of different "
        "sizes inside one call; use --steps-per-execution 1")
    one_process = types.SimpleNamespace(devices=gpus.devices, cluster_resolver=None)
    assert run.steps_per_execution(config("sampled", given=4), one_process) \
        .train.steps_per_execution == 4
