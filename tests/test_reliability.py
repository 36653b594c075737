"""Crash safety: exact resume after SIGKILL, clean stop on SIGTERM, damaged checkpoints,
non-finite steps. Real processes, real signals."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf

from conftest import PINNED, assert_resumed_from
from faults import (checkpoint_tensors, compare_tensors, latest_step,
                    start_train, write_tiny_corpus)
from tfpar.tools.cli import train_main


def run_args(corpus, tmp, name, steps=60):
    """60 steps: at least 50 past the kill points between steps and in a checkpoint write,
    for a small difference to grow."""
    return [
        # hidden 384: a checkpoint large enough (~7 MB with Adam slots) that its write
        # takes long enough for the test to catch a kill in the middle of it.
        "--data", str(corpus), *PINNED,
        "--embed-dim", "16", "--hidden-dim", "384", "--dropout", "0.1",
        "--batch-size", "16", "--epochs", "4", "--max-steps", str(steps), "--no-progress",
        "--checkpoint-every", "2", "--deterministic", "--seed", "3",
        "--model-dir", str(tmp / name), "--export-dir", str(tmp / (name + "-export")),
        "--metrics-json", str(tmp / (name + ".json")),
    ]


def assert_same_tensors(got, expected):
    """Two checkpoint_tensors() dicts: the same tensors, each bit-identical."""
    assert any(k.startswith("layers/rnn_0") for k in got)  # the LSTM weights are compared
    assert any(k.startswith("moments/") for k in got)  # and the optimizer's slots
    comparison = compare_tensors(got, expected)
    assert comparison.exact, comparison.describe()


def start(args):
    return start_train(args)


def wait_for(predicate, proc, timeout=600.0, interval=0.02):
    """Polls ``predicate`` until true; fails if the process ends first or time runs out
    (a deadline for a hung run, not a speed check: a clean-clone run beside another test
    session once took over 180 s to reach a kill point these runs reach in 10-60 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"process ended before the kill point:\n{proc.stdout.read()}")
        if interval:
            time.sleep(interval)
    proc.kill()
    pytest.fail("kill point never reached")


def has_checkpoint(model_dir, step):
    return lambda: os.path.exists(model_dir / "checkpoints" / f"ckpt-{step}.index")


def writing_checkpoint(model_dir, after_step):
    """True while a checkpoint after ``after_step`` is being written (temp files exist)."""
    def check():
        temps = glob.glob(str(model_dir / "checkpoints" / "*_temp*"))
        return bool(temps) and has_checkpoint(model_dir, after_step)()
    return check


def exporting(export_dir):
    return lambda: bool(glob.glob(str(export_dir / "tfpar_lm" / ".staging-*")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run's final parameters."""
    from conftest import tiny_corpus_dir  # noqa: F401  (fixture body reused below)

    tmp = tmp_path_factory.mktemp("reference")
    corpus = make_corpus(tmp)
    assert train_main(run_args(corpus, tmp, "ref")) == 0
    return corpus, checkpoint_tensors(tmp / "ref")


def make_corpus(tmp):
    """The tiny corpus (300/40/40 sentences) in ``tmp/corpus``."""
    return Path(write_tiny_corpus(str(tmp / "corpus")))


@pytest.mark.parametrize("point", ["while-checkpointing", "while-exporting"])
def test_sigkill_then_resume_ends_with_the_same_parameters(point, reference, tmp_path):
    """The kills check that the write was still under way when the kill came (its
    temporary files or staging dir outlived the process); when it had just ended between
    the poll and the kill, the attempt is repeated on a fresh model dir. (A kill between
    two steps, resumed bit for bit: test_faults.py::test_killed_runs_resume_exactly, one
    process, and test_launch_local.py::test_a_killed_worker_is_restarted_and_the_run_completes,
    two workers.)"""
    corpus, expected = reference
    model_dir, export_dir = tmp_path / "run", tmp_path / "run-export"
    for _attempt in range(5):
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(export_dir, ignore_errors=True)
        proc = start(run_args(corpus, tmp_path, "run"))
        if point == "while-checkpointing":
            # A write's temporary files live ~5 ms: a poll that sleeps 0.5 ms between looks
            # wakes ahead of busy processes, where a spinning one loses its turn on a loaded
            # host (beside two CPU hogs: 4 kills in 6 inside the write, against 6 in 6).
            wait_for(writing_checkpoint(model_dir, 6), proc, interval=0.0005)
        else:
            wait_for(exporting(export_dir), proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
        # What the kill interrupted is still on disk: nothing finished it after the kill.
        if (point == "while-checkpointing" and writing_checkpoint(model_dir, 6)()) or \
                (point == "while-exporting" and exporting(export_dir)()):
            break
    else:
        pytest.fail(f"5 kills in a row came after the {point} write had ended")
    assert not glob.glob(str(export_dir / "tfpar_lm" / "[0-9]*")), "half-written export visible"
    # The checkpoint the kill left: the one the state file names, which lags the newest
    # .index file while a checkpoint is finished (ckpt-4 can still be the latest when the
    # kill comes with ckpt-6.index written).
    left = latest_step(str(model_dir))
    assert left is not None and left >= {"while-checkpointing": 4,
                                         "while-exporting": 60}[point], left

    resumed = start(run_args(corpus, tmp_path, "run"))
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert_resumed_from(out, left)
    assert_same_tensors(checkpoint_tensors(model_dir), expected)
    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 60
    assert os.path.exists(export_dir / "tfpar_lm" / "1" / "saved_model.pb")


def test_sigterm_stops_after_the_step_with_a_checkpoint(tmp_path):
    corpus = make_corpus(tmp_path)
    args = run_args(corpus, tmp_path, "run", steps=100000)
    args[args.index("--epochs") + 1] = "1000"
    proc = start(args)
    wait_for(has_checkpoint(tmp_path / "run", 2), proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: stopped by SIGTERM after step ")
    assert last.endswith("; run the same command again to resume")
    step = int(last.split("after step ")[1].split(";")[0])
    assert os.path.exists(tmp_path / "run" / "checkpoints" / f"ckpt-{step}.index")


def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    corpus = make_corpus(tmp_path)
    args = run_args(corpus, tmp_path, "run", steps=6)
    assert train_main(args + ["--no-export"]) == 0
    data = glob.glob(str(tmp_path / "run" / "checkpoints" / "ckpt-6.data-*"))[0]
    with open(data, "r+b") as f:
        f.truncate(10)
    args[args.index("--max-steps") + 1] = "8"
    capsys.readouterr()
    assert train_main(args + ["--no-export"]) == 0
    log = capsys.readouterr().err
    assert "ckpt-6 is unreadable" in log
    assert_resumed_from(log, 4)
    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 8


def test_non_finite_step_stops_without_applying(tiny_args, capsys, tmp_path):
    code = train_main(tiny_args + ["--optimizer", "sgd", "--lr", "1e38", "--clip-norm", "0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err.startswith("error: non-finite loss or gradient in the batch after step ")
    assert "the update was not applied" in err and "--on-nan skip" in err


def test_non_finite_steps_are_skipped_with_on_nan_skip(tiny_args, tmp_path):
    code = train_main(tiny_args + ["--optimizer", "sgd", "--lr", "1e38", "--clip-norm", "0",
                                   "--on-nan", "skip", "--nan-patience", "0", "--no-export"])
    assert code == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["skipped_batches"] > 0


def test_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(
        tiny_args, capsys, tmp_path, monkeypatch):
    import errno


    real_save = tf.train.CheckpointManager.save
    calls = []

    def failing_save(self, checkpoint_number=None, **kw):
        calls.append(checkpoint_number)
        if checkpoint_number == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, checkpoint_number=checkpoint_number, **kw)

    monkeypatch.setattr(tf.train.CheckpointManager, "save", failing_save)
    code = train_main(tiny_args + ["--checkpoint-every", "2"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err.startswith("error: cannot write the checkpoint of step 4 to ")
    assert "No space left on device; free space or give another --model-dir" in err
    state = tf.train.get_checkpoint_state(str(tmp_path / "run" / "checkpoints"))
    assert state.model_checkpoint_path.endswith("ckpt-2")
    assert not (tmp_path / "export").exists()


# mirrored in stream mode (replicas, the carried state gathered from them); default's
# resume is the SIGKILL tests' above (sentence) and the fault tool's kill test's (stream),
# sentence mode's with several steps a call test_steps_per_execution's.
@pytest.mark.parametrize("strategy,mode", [("mirrored", "stream")])
def test_a_resumed_run_repeats_an_uninterrupted_one_exactly(strategy, mode, tiny_corpus_dir,
                                                            tmp_path, capsys):
    """60 steps, or 10 then 60 on the same model dir: every tensor bit-identical, and the
    same perplexities. Sentence mode: batch shapes vary, and a step function's graph must
    not depend on which shape it was first traced with (it once selected XLA kernels for
    the first shape only, so a resumed run drifted by ~1e-7 per weight). Stream mode: the
    checkpoint carries the recurrent state the next window starts from."""
    def run(name, steps, resumes_from=None):
        args = ["--data", str(tiny_corpus_dir), "--mode", mode, "--bptt", "8",
                "--strategy", strategy, *PINNED, "--embed-dim", "16",
                "--hidden-dim", "16", "--dropout", "0.1", "--batch-size", "8", "--epochs", "3",
                "--max-steps", str(steps), "--no-progress", "--no-export", "--deterministic",
                "--checkpoint-every", "5", "--seed", "3", "--model-dir", str(tmp_path / name),
                "--metrics-json", str(tmp_path / f"{name}-{steps}.json")]
        capsys.readouterr()
        assert train_main(args) == 0
        assert_resumed_from(capsys.readouterr().err, resumes_from)
        return json.loads((tmp_path / f"{name}-{steps}.json").read_text())

    whole = run("whole", 60)
    run("resumed", 10)
    resumed = run("resumed", 60, resumes_from=10)
    assert_same_tensors(checkpoint_tensors(tmp_path / "resumed"),
                        checkpoint_tensors(tmp_path / "whole"))
    assert (resumed["steps"], resumed["valid_ppl"], resumed["test_ppl"]) == \
        (whole["steps"], whole["valid_ppl"], whole["test_ppl"])


def test_a_run_that_ignores_its_checkpoint_fails_the_resume_check(tiny_args, tmp_path, capsys,
                                                                 monkeypatch):
    """Training is deterministic, so a run that ignored its checkpoint and trained from
    step 0 ends with the same tensors and step count as one that resumed; the resume
    tests' check (the "resumed from .../ckpt-N (step N)" line) tells them apart."""
    from tfpar.training.checkpoints import Checkpointer

    args = tiny_args + ["--no-export", "--checkpoint-every", "1"]
    assert train_main(with_max_steps(args, 2)) == 0
    saved = []
    real_save = Checkpointer.save

    def save(self, step):
        saved.append(step)
        real_save(self, step)

    monkeypatch.setattr(Checkpointer, "restore_latest", lambda self: None)  # the bug
    monkeypatch.setattr(Checkpointer, "save", save)
    capsys.readouterr()
    assert train_main(with_max_steps(args, 3)) == 0
    err = capsys.readouterr().err
    # What the final-tensor comparisons see: the step count the resumed run would reach.
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 3
    assert int(checkpoint_tensors(tmp_path / "run")[
        "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 3
    # What the resume check sees: no "resumed from" line, and training from step 0.
    assert "resumed from" not in err and sorted(set(saved)) == [1, 2, 3]
    with pytest.raises(AssertionError, match="started at step 0, ignoring the checkpoint of "
                                             "step 2"):
        assert_resumed_from(err, 2)


def with_max_steps(args, steps):
    args = list(args)
    args[args.index("--max-steps") + 1] = str(steps)
    return args


def test_writer_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path, caplog):
    from tfpar.errors import ConfigError
    from tfpar.training.checkpoints import WriterLock

    first = WriterLock(str(tmp_path))
    first.acquire()
    holder = json.loads((tmp_path / "LOCK").read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=rf"--model-dir '{tmp_path}' is in use by pid "
                                          rf"{os.getpid()} on \S+ \(lock .*LOCK\); wait for "
                                          "that run to end, or use another --model-dir"):
        WriterLock(str(tmp_path)).acquire()
    first.release()
    assert not (tmp_path / "LOCK").exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (tmp_path / "LOCK").write_text(json.dumps({"pid": int(dead.stdout), "host": holder["host"]}))
    second = WriterLock(str(tmp_path))
    with caplog.at_level("WARNING", logger="tfpar"):
        second.acquire()
    assert "taking over the stale lock" in caplog.text
    assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
    second.release()

    (tmp_path / "LOCK").write_text(json.dumps({"pid": 1, "host": "another-host"}))
    with pytest.raises(ConfigError, match="is in use by pid 1 on another-host"):
        WriterLock(str(tmp_path)).acquire()  # another host's pid cannot be checked


def test_a_second_run_on_a_model_dir_in_use_is_refused(tiny_corpus_dir, tmp_path, capsys):
    model_dir = tmp_path / "run"
    first = start(["--data", str(tiny_corpus_dir), *PINNED,
                   "--embed-dim", "16", "--hidden-dim", "16",
                   "--batch-size", "8", "--epochs", "20", "--max-steps", "400",
                   "--no-progress", "--no-export", "--model-dir", str(model_dir),
                   "--metrics-json", str(tmp_path / "first.json")])
    wait_for(lambda: (model_dir / "checkpoints").exists() or (model_dir / "train").exists(),
             first)
    assert (model_dir / "LOCK").exists()
    code = train_main(["--data", str(tiny_corpus_dir), *PINNED,
                       "--embed-dim", "16", "--hidden-dim",
                       "16", "--batch-size", "8", "--max-steps", "5", "--no-progress",
                       "--no-export", "--model-dir", str(model_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"is in use by pid {first.pid}" in err
    assert [l for l in err.splitlines() if l.startswith("error:")] == [err.strip().splitlines()[-1]]
    assert "Traceback" not in err
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out  # the first run is unharmed
    assert json.loads((tmp_path / "first.json").read_text())["steps"] == 400
    assert not (model_dir / "LOCK").exists()
