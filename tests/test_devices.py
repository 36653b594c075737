"""Thread pools for runs on logical CPU devices (tfpar.parallel.devices)."""

import subprocess
import sys

import pytest

from tfpar.parallel import devices
from tfpar.config import DistConfig


@pytest.mark.parametrize("strategy,cpu_devices,cores,want", [
    ("mirrored", 2, 2, 1),  # two replicas side by side, one core each
    ("tower", 2, 8, 4),
    ("pipeline", 3, 8, 2),
    ("mirrored", 4, 2, 1),  # never below one thread
    ("mirrored", 1, 8, 0),  # one device: TF's default (every core)
    ("default", 2, 2, 0),
    ("one_device", 1, 2, 0),
])
def test_automatic_intra_op_threads_share_the_cores(strategy, cpu_devices, cores, want,
                                                    monkeypatch):
    monkeypatch.setattr(devices, "host_cores", lambda: cores)
    monkeypatch.setattr(devices, "num_gpus", lambda: 0)
    assert devices.intra_op_threads(DistConfig(strategy=strategy), cpu_devices) == want


def test_explicit_threads_win_and_gpus_keep_the_default(monkeypatch):
    monkeypatch.setattr(devices, "host_cores", lambda: 8)
    assert devices.intra_op_threads(DistConfig(strategy="mirrored", intra_op_threads=3), 2) == 3
    monkeypatch.setattr(devices, "num_gpus", lambda: 2)
    assert devices.intra_op_threads(DistConfig(strategy="mirrored"), 2) == 0


SCRIPT = """
import tensorflow as tf
from tfpar.parallel import devices
from tfpar.tools.cli import prepare_runtime
from tfpar.config import DistConfig
devices.host_cores = lambda: 4
devices.num_gpus = lambda: 0  # the rule for a CPU-only host, on any host
prepare_runtime(DistConfig(strategy="mirrored", cpu_devices=2))
print(tf.config.threading.get_intra_op_parallelism_threads(),
      len(tf.config.list_logical_devices("CPU")))
"""


def test_prepare_runtime_sets_the_share_before_tensorflow_starts():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2", "2"]


def test_a_late_request_is_logged_and_ignored(caplog):
    # The test process's runtime is already initialised (tests/conftest.py).
    before = __import__("tensorflow").config.threading.get_intra_op_parallelism_threads()
    devices.configure_threads(before + 1)
    assert "intra-op threads stay at TensorFlow's setting" in caplog.text
    assert __import__("tensorflow").config.threading.get_intra_op_parallelism_threads() == before


def test_an_automatic_share_asked_for_late_is_quiet(caplog):
    import logging

    caplog.set_level(logging.INFO)
    before = __import__("tensorflow").config.threading.get_intra_op_parallelism_threads()
    devices.configure_threads(before + 1, requested=False)
    assert "intra-op threads" not in caplog.text
