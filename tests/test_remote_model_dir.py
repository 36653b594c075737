"""A model dir, export dir and metrics file given by a URL: tfpar reads and writes them
through ``tf.io.gfile``, so ``gs://``, ``s3://`` and ``hdfs://`` work where TensorFlow has
the plug-in. Tested on ``ram://``, TensorFlow's in-memory file system (one process: the
runs are in-process), which like an object store has no O_EXCL, no folder rename and no
modification times."""

import json
import os
import re
import socket
import time
import uuid

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_resumed_from, load_script, small_config
from tfpar.serving import export
from tfpar.errors import CheckpointError, ConfigError
from tfpar.training import checkpoints, hparams
from tfpar.training.checkpoints import WriterLock


@pytest.fixture
def ram_root():
    """A fresh ``ram://`` folder, removed afterwards (the file system lives as long as
    the process)."""
    root = f"ram://tfpar-{uuid.uuid4().hex[:8]}"
    tf.io.gfile.makedirs(root)
    yield root
    if tf.io.gfile.exists(root):
        tf.io.gfile.rmtree(root)


def with_flag(args, flag, value):
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


def assert_nothing_local_named_ram(folder):
    """``os.makedirs("ram://x")`` would have made ``./ram:/x``."""
    assert not [p for p in folder.rglob("ram:*")], sorted(folder.rglob("*"))


def test_a_run_on_ram_trains_resumes_exports_and_logs(tiny_args, ram_root, tmp_path,
                                                     monkeypatch, capsys):
    from tfpar.tools.cli import train_main

    monkeypatch.chdir(tmp_path)  # where a URL mistaken for a local path would land
    args = with_flag(with_flag(tiny_args, "--max-steps", "3"), "--batch-size", "64")
    args = with_flag(with_flag(with_flag(args, "--model-dir", f"{ram_root}/run"),
                               "--export-dir", f"{ram_root}/export"),
                     "--metrics-json", f"{ram_root}/metrics.json")
    assert train_main(args + ["--no-export"]) == 0  # 3 of the epoch's 5 steps
    assert json.loads(tf.io.gfile.GFile(f"{ram_root}/metrics.json").read())["steps"] == 3
    capsys.readouterr()
    assert train_main(with_flag(args, "--max-steps", "1000")) == 0  # the rest of the epoch
    assert_resumed_from(capsys.readouterr().err, 3)
    metrics = json.loads(tf.io.gfile.GFile(f"{ram_root}/metrics.json").read())
    assert metrics["steps"] == 5 and metrics["model_dir"] == f"{ram_root}/run"

    run = f"{ram_root}/run"
    names = {os.path.basename(p) for p in tf.io.gfile.glob(f"{run}/*")}
    sessions = {f for f in names if f.startswith("events.out.tfevents.")}
    assert names - sessions == {
        "config.json", "vocab.txt", "checkpoints", "best", "metrics.jsonl", "train", "eval",
        "final_step.json"}  # the end of the run, for a side-car evaluator
    # The HParams session, written by the first run only.
    assert len(sessions) == 1 and hparams.recorded(run)["batch_size"] == 64
    (line,) = tf.io.gfile.GFile(f"{run}/metrics.jsonl").read().splitlines()
    assert (json.loads(line)["epoch"], json.loads(line)["step"]) == (1, 5)
    for events in ("train", "eval"):  # one file per run
        assert len(tf.io.gfile.glob(f"{run}/{events}/events.out.tfevents.*")) == 2, events
    assert tf.train.latest_checkpoint(f"{run}/checkpoints").endswith("ckpt-5")

    version = f"{ram_root}/export/tfpar_lm/1"
    assert metrics["export_path"] == version
    assert tf.io.gfile.listdir(f"{ram_root}/export/tfpar_lm") == ["1"]  # no staging left
    assert {p[len(version):] for p in tf.io.gfile.glob(f"{version}/*")} >= {
        "/saved_model.pb", "/assets", "/variables"}
    assert tf.io.gfile.glob(f"{version}/variables/variables.index")
    assert tf.io.gfile.GFile(f"{version}/assets/vocab.txt").read() == \
        tf.io.gfile.GFile(f"{run}/vocab.txt").read()
    scored = tf.saved_model.load(version).signatures["score"](text=tf.constant(["w1 w2 w3"]))
    assert scored["tokens"].numpy().tolist() == [4]
    assert np.isfinite(scored["nll"].numpy()).all()
    assert export.resolve_saved_model(f"{ram_root}/export/tfpar_lm") == version

    capsys.readouterr()  # scripts/evaluate.py reads the run back from ram://
    assert load_script("evaluate").main(["--model-dir", run, "--split", "test", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["model"] == f"{run}/checkpoints/ckpt-5"
    assert evaluated["perplexity"] == pytest.approx(metrics["test_ppl"], rel=1e-6)
    assert_nothing_local_named_ram(tmp_path)


@pytest.mark.parametrize("flag", ["--model-dir", "--export-dir", "--metrics-json"])
def test_a_url_without_a_file_system_is_refused_before_training(flag, tiny_args, tmp_path,
                                                                capsys):
    from tfpar.tools.cli import train_main

    assert train_main(with_flag(tiny_args, flag, "nosuch://bucket/x")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(  # the file systems there are depend on what is installed
        rf"error: {flag} 'nosuch://bucket/x': TensorFlow has no file system for nosuch:// "
        r"here \(it has .*ram://.* and local paths\); s3://, hdfs:// and az:// need "
        r"tensorflow-io \(pip install tensorflow-io\)", err), err
    assert not (tmp_path / "run").exists()  # nothing written


# ----------------------------------------------------------------------------- the lock
def write_ram_lock(root, pid, host, *, beat_age):
    """Another run's lock, put in place as a run does it: written aside, then renamed over
    LOCK (a remove and a write would race a holder's heartbeat: its rename could land
    between them, and ram://'s "w" appends to an existing file)."""
    tmp = f"{root}/.other-{uuid.uuid4().hex}.tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(json.dumps({"pid": pid, "host": host, "process": "another-process",
                            "token": "theirs", "beat": time.time() - beat_age}))
    RENAME(tmp, f"{root}/LOCK", overwrite=True)


RENAME = tf.io.gfile.rename  # the real one, where a test patches tf.io.gfile.rename


def test_a_held_ram_lock_refuses_a_second_writer_until_released(ram_root):
    first = WriterLock(ram_root)
    first.acquire()
    try:
        holder = json.loads(tf.io.gfile.GFile(f"{ram_root}/LOCK").read())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(ConfigError, match=rf"is in use by pid {os.getpid()} on "):
            WriterLock(ram_root).acquire()
    finally:
        first.release()
    assert tf.io.gfile.listdir(ram_root) == []  # no LOCK, no temporary file
    second = WriterLock(ram_root)
    second.acquire()
    second.release()


def test_another_hosts_ram_lock_is_taken_over_only_when_its_lease_has_expired(ram_root,
                                                                              caplog):
    """ram:// keeps no modification times: the lease runs from the beat written in it."""
    write_ram_lock(ram_root, 4242, "node-a", beat_age=30)
    with pytest.raises(ConfigError, match=r"is in use by pid 4242 on node-a \(lock ram://"):
        WriterLock(ram_root, lease=60).acquire()  # heard from 30 s ago: alive
    write_ram_lock(ram_root, 4242, "node-a", beat_age=90)
    lock = WriterLock(ram_root, lease=60)
    with caplog.at_level("WARNING", logger="tfpar"):
        lock.acquire()
    try:
        assert "of pid 4242 on node-a (another host, no heartbeat for 90 s, over the 60 s " \
               "lease)" in caplog.text
        assert json.loads(tf.io.gfile.GFile(f"{ram_root}/LOCK").read())["pid"] == os.getpid()
    finally:
        lock.release()


def test_the_ram_lock_holder_renews_its_lease_and_notices_when_it_lost_the_lock(ram_root,
                                                                              caplog):
    lock = WriterLock(ram_root, heartbeat=0.05)
    lock.acquire()
    try:
        def beat():
            return json.loads(tf.io.gfile.GFile(f"{ram_root}/LOCK").read())["beat"]

        first, deadline = beat(), time.monotonic() + 30
        while beat() == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beat() > first  # rewritten by the heartbeat
        write_ram_lock(ram_root, 4242, "node-b", beat_age=0)  # another run's rename won
        with caplog.at_level("ERROR", logger="tfpar"):
            while "lost the lock" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert f"lost the lock {ram_root}/LOCK to pid 4242 on node-b" in caplog.text
    finally:
        lock.release()
    # Released without deleting the other run's lock.
    assert json.loads(tf.io.gfile.GFile(f"{ram_root}/LOCK").read())["pid"] == 4242


def test_a_ram_lock_holder_waits_out_a_torn_lock_then_says_it_was_removed(
        ram_root, caplog, monkeypatch):
    """A missing or unreadable lock is read again for UNREADABLE_BEATS heartbeats (a
    takeover that removes and writes leaves it so for a moment) before the holder says it
    lost the lock: then to whom, or that it was removed."""
    lock = WriterLock(ram_root, heartbeat=0.05)
    lock.acquire()
    read, torn = WriterLock._read, []

    def torn_reads_first(self):  # the next UNREADABLE_BEATS reads find a torn lock
        if torn:
            torn.pop()
            return {}
        return read(self)

    monkeypatch.setattr(WriterLock, "_read", torn_reads_first)
    try:
        torn.extend([None] * checkpoints.UNREADABLE_BEATS)
        write_ram_lock(ram_root, 4242, "node-b", beat_age=0)
        deadline = time.monotonic() + 30
        with caplog.at_level("ERROR", logger="tfpar"):
            while "lost the lock" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert not torn
        assert f"lost the lock {ram_root}/LOCK to pid 4242 on node-b" in caplog.text
    finally:
        lock.release()

    lock = WriterLock(ram_root + "-removed", heartbeat=0.05)
    lock.acquire()
    try:
        tf.io.gfile.remove(f"{ram_root}-removed/LOCK")
        deadline = time.monotonic() + 30
        with caplog.at_level("ERROR", logger="tfpar"):
            while "was removed" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert (f"lost the lock {ram_root}-removed/LOCK: it was removed or cannot be read "
                f"for {checkpoints.UNREADABLE_BEATS + 1} heartbeats; another run may write "
                f"to --model-dir {ram_root}-removed; stop one of them") in caplog.text
    finally:
        lock.release()


def test_a_ram_lock_is_held_only_if_it_reads_back_its_own_token(ram_root, monkeypatch):
    """Two runs pass rename(overwrite=False)'s check at once: the later rename wins, and
    the earlier run, reading the lock back, finds the other's token and is refused."""
    rename = tf.io.gfile.rename

    def and_another_run_renames_right_after(src, dst, overwrite=False):
        rename(src, dst, overwrite=overwrite)
        if dst.endswith("/LOCK"):
            write_ram_lock(ram_root, 4242, "node-b", beat_age=0)

    monkeypatch.setattr(tf.io.gfile, "rename", and_another_run_renames_right_after)
    lock = WriterLock(ram_root)
    with pytest.raises(ConfigError, match=r"is in use by pid 4242 on node-b"):
        lock.acquire()
    assert not lock.held


def test_the_config_and_vocab_of_a_ram_model_dir_are_checked_on_resume(ram_root, tmp_path,
                                                                     monkeypatch):
    """config.json and vocab.txt are written to and read back from the URL."""
    from tfpar import config as cfg
    from tfpar.data.vocab import Vocab

    monkeypatch.chdir(tmp_path)
    vocab = Vocab(tokens=("<pad>", "<unk>", "<eos>", "a", "b"))
    config = small_config(run=cfg.RunConfig(model_dir=f"{ram_root}/run"))
    with checkpoints.open_model_dir(config, True, vocab=vocab) as model_dir:
        assert model_dir == f"{ram_root}/run"
        assert tf.io.gfile.exists(f"{model_dir}/LOCK")
    assert tf.io.gfile.GFile(f"{ram_root}/run/vocab.txt").read() == "<pad>\n<unk>\n<eos>\na\nb\n"
    assert cfg.Config.from_json(tf.io.gfile.GFile(f"{ram_root}/run/config.json").read()) == config
    other = Vocab(tokens=("<pad>", "<unk>", "<eos>", "a", "c"))
    with pytest.raises(CheckpointError, match=r"cannot resume ram://.*/run: vocabulary: the saved "
                                        r"vocab.txt \(5 entries\)"):
        with checkpoints.open_model_dir(config, True, vocab=other):
            pass
    bigger = config.replace(model={"hidden_dim": config.model.hidden_dim * 2})
    with pytest.raises(CheckpointError, match=r"cannot resume ram://.*/run: model.hidden_dim"):
        with checkpoints.open_model_dir(bigger, True, vocab=vocab):
            pass
    assert sorted(tf.io.gfile.listdir(f"{ram_root}/run")) == ["config.json", "vocab.txt"]
    assert_nothing_local_named_ram(tmp_path)


def test_an_export_to_a_url_moves_saved_model_pb_last_and_a_failed_move_leaves_nothing(
        ram_root, monkeypatch):
    """A folder rename on a URL is no single step (ram:// moves no files at all), so the
    files are moved one by one, saved_model.pb last: until it lands the version is no
    SavedModel to any reader, and a failure removes what was moved."""
    from tfpar.data.vocab import Vocab
    from tfpar.model.lm import build_model

    vocab = Vocab(tokens=("<pad>", "<unk>", "<eos>", "a", "b"))
    config = small_config().replace(model={"embed_dim": 4, "hidden_dim": 4, "layers": 1},
                              run={"export_dir": f"{ram_root}/models", "export_name": "lm"})
    rename, moved = tf.io.gfile.rename, []

    def fails_at_saved_model_pb(src, dst, overwrite=False):
        if dst.endswith("/1/saved_model.pb"):
            assert not tf.saved_model.contains_saved_model(f"{ram_root}/models/lm/1")
            raise tf.errors.UnavailableError(None, None, "connection reset")
        moved.append(dst)
        rename(src, dst, overwrite=overwrite)

    monkeypatch.setattr(tf.io.gfile, "rename", fails_at_saved_model_pb)
    with pytest.raises(CheckpointError, match=r"^export to 'ram://.*/models/lm' failed: "
                                              r"connection reset; nothing was written$"):
        export.export_model(build_model(config.model, len(vocab), seed=1), vocab, config.run)
    assert {m.rpartition("/lm/1/")[2] for m in moved if "/lm/1/" in m} >= {
        "fingerprint.pb", "assets/vocab.txt", "variables/variables.index"}
    assert tf.io.gfile.listdir(ram_root) == []  # no version, no staging, no folders made
