"""The model dir's writer lock across restarts: a restarted container (same host, same
pid), a requeue on another host (an expired lease), and a live run (refused)."""

import json
import os
import socket
import time

import pytest

from tfpar.errors import ConfigError
from tfpar.training import checkpoints
from tfpar.training.checkpoints import WriterLock


def write_lock(folder, pid, host, *, process="an-earlier-process", age=0.0):
    path = folder / "LOCK"
    path.write_text(json.dumps({"pid": pid, "host": host, "process": process}))
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


@pytest.mark.parametrize("pid", [1, None])
def test_a_restarted_container_takes_over_its_own_lock(pid, tmp_path, monkeypatch, caplog):
    """After an OOM kill the container comes back with its hostname and often pid 1:
    the lock names this host and this pid, but another process wrote it."""
    if pid is not None:
        monkeypatch.setattr(checkpoints.os, "getpid", lambda: pid)
    me = os.getpid()
    write_lock(tmp_path, me, socket.gethostname())
    lock = WriterLock(str(tmp_path))
    with caplog.at_level("WARNING", logger="tfpar"):
        lock.acquire()
    try:
        assert "taking over the stale lock" in caplog.text
        assert "written by an earlier process with this pid: a restart" in caplog.text
        holder = json.loads((tmp_path / "LOCK").read_text())
        assert holder["pid"] == me and holder["process"] == checkpoints._INCARNATION
    finally:
        lock.release()


def test_this_process_holding_the_lock_still_refuses_a_second_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints.os, "getpid", lambda: 1)
    first = WriterLock(str(tmp_path))
    first.acquire()
    try:
        with pytest.raises(ConfigError, match="is in use by pid 1 on "):
            WriterLock(str(tmp_path)).acquire()
    finally:
        first.release()


def test_another_hosts_lock_is_taken_over_only_when_its_lease_has_expired(tmp_path, caplog):
    write_lock(tmp_path, 4242, "node-a", age=30)
    with pytest.raises(ConfigError, match=r"is in use by pid 4242 on node-a \(lock "):
        WriterLock(str(tmp_path), lease=60).acquire()  # heard from 30 s ago: alive
    write_lock(tmp_path, 4242, "node-a", age=90)
    lock = WriterLock(str(tmp_path), lease=60)
    with caplog.at_level("WARNING", logger="tfpar"):
        lock.acquire()
    try:
        assert "of pid 4242 on node-a (another host, no heartbeat for 90 s, over the 60 s " \
               "lease)" in caplog.text
    finally:
        lock.release()


def test_the_holder_keeps_its_lease_alive(tmp_path):
    lock = WriterLock(str(tmp_path), heartbeat=0.05)
    lock.acquire()
    try:
        old = time.time() - 1000
        os.utime(tmp_path / "LOCK", (old, old))
        deadline = time.monotonic() + 30
        while os.path.getmtime(tmp_path / "LOCK") < old + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.getmtime(tmp_path / "LOCK") > old + 1  # refreshed by the heartbeat
        with pytest.raises(ConfigError, match="is in use by pid"):
            WriterLock(str(tmp_path), lease=60).acquire()
    finally:
        lock.release()
    assert not (tmp_path / "LOCK").exists()
