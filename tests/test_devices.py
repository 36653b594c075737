"""Thread pools for runs on logical CPU devices (tfpar.parallel.devices)."""

import subprocess
import sys

import pytest

from conftest import small_config, train_config
from tfpar.parallel import devices, registry
from tfpar.config import DistConfig


@pytest.mark.parametrize("strategy,cpu_devices,cores,want", [
    ("mirrored", 2, 2, 1),  # two replicas side by side, one core each
    ("tower", 2, 8, 4),
    ("pipeline", 3, 8, 2),
    ("mirrored", 4, 2, 1),  # never below one thread
    ("mirrored", 1, 8, 0),  # one device: TF's default (every core)
    ("parallel_do", 2, 2, 1),
    ("default", 2, 2, 0),
    ("one_device", 1, 2, 0),
    ("multi_worker", 2, 2, 0),  # one CPU device per task: nothing to share
])
def test_automatic_intra_op_threads_share_the_cores(strategy, cpu_devices, cores, want,
                                                    monkeypatch):
    monkeypatch.setattr(devices, "host_cores", lambda: cores)
    monkeypatch.setattr(devices, "num_gpus", lambda: 0)
    assert registry.intra_op_threads(DistConfig(strategy=strategy), cpu_devices) == want


def test_explicit_threads_win_and_gpus_keep_the_default(monkeypatch):
    monkeypatch.setattr(devices, "host_cores", lambda: 8)
    assert registry.intra_op_threads(DistConfig(strategy="mirrored", intra_op_threads=3), 2) == 3
    monkeypatch.setattr(devices, "num_gpus", lambda: 2)
    assert registry.intra_op_threads(DistConfig(strategy="mirrored"), 2) == 0


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


# ---------------------------------------------------------------- which devices train
@pytest.mark.parametrize("gpus,want", [
    (0, ["/device:CPU:0", "/device:CPU:1"]),  # no GPU: --cpu-devices' default, 2 CPUs
    (1, ["/device:GPU:0"]),  # one GPU: one replica on it, not 2 logical CPUs
    (3, ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"]),
])
@pytest.mark.parametrize("strategy", ["mirrored", "tower", "parallel_do"])
def test_a_data_parallel_strategy_trains_on_every_gpu_else_logical_cpus(gpus, want, strategy,
                                                                         monkeypatch, caplog):
    """GPU counts patched (the device list TensorFlow reports)."""
    import logging

    monkeypatch.setattr(devices, "num_gpus", lambda: gpus)
    with caplog.at_level(logging.INFO, logger="tfpar.parallel.devices"):
        assert devices.data_parallel_devices(DistConfig(strategy=strategy)) == want
    assert (f"using {gpus} GPU(s): " if gpus else "no GPUs: using 2 logical CPU devices") \
        in caplog.text


CPUS, GPUS = "/device:CPU:0, /device:CPU:1", "/device:GPU:0, /device:GPU:1"


@pytest.mark.parametrize("gpus,all_reduce,want", [
    (0, "auto", f"2 replica(s) on {CPUS}; all-reduce ReductionToOneDevice"),
    (0, "hierarchical_copy", f"2 replica(s) on {CPUS}; all-reduce HierarchicalCopyAllReduce"),
    (2, "auto", f"2 replica(s) on {GPUS}; all-reduce NcclAllReduce"),
    (1, "auto", "1 replica(s) on /device:GPU:0; all-reduce ReductionToOneDevice (one replica: "
                "nothing to reduce)"),
])
def test_mirrored_names_the_all_reduce_it_was_built_with(gpus, all_reduce, want, monkeypatch):
    """The start-up line ``strategy mirrored: ...`` (training logs ``describe()``) names
    the cross-device ops the strategy sums with: NCCL on 2 or more GPUs (GPU counts
    patched; TensorFlow builds a MirroredStrategy over GPU names without touching them),
    reduction to one device on CPUs. The GPU suite checks NCCL on real GPUs."""
    import tensorflow as tf

    monkeypatch.setattr(devices, "num_gpus", lambda: gpus)
    plugin = registry.build_strategy(DistConfig(strategy="mirrored", all_reduce=all_reduce))
    assert plugin.describe() == f"mirrored: {want}"
    assert isinstance(plugin.cross_device_ops, tf.distribute.NcclAllReduce) == (gpus == 2)


@pytest.mark.parametrize("gpus", [1, 2])
def test_cpu_devices_on_a_host_with_gpus_is_an_error_not_ignored(gpus, monkeypatch):
    from tfpar.errors import ConfigError

    monkeypatch.setattr(devices, "num_gpus", lambda: gpus)
    with pytest.raises(ConfigError) as e:
        devices.data_parallel_devices(DistConfig(strategy="mirrored", cpu_devices=2))
    assert str(e.value) == (
        f"--cpu-devices 2: this host has {gpus} GPU(s), which --strategy mirrored trains on; "
        "drop --cpu-devices, name devices with --devices, or hide the GPUs "
        "(CUDA_VISIBLE_DEVICES=) to train on logical CPUs")
    # Naming the devices is the explicit choice.
    assert devices.data_parallel_devices(DistConfig(strategy="mirrored", cpu_devices=2,
                                                    devices=("/cpu:0", "/cpu:1"))) == \
        ["/device:CPU:0", "/device:CPU:1"]


def test_the_cpu_suite_hides_any_gpu_from_itself_and_its_subprocesses():
    """tests/conftest.py: on a GPU host the suite still tests the CPU paths it was
    written for (the GPU suite is tests/gpu, make gpu-check)."""
    import os

    from tfpar.parallel.host import gpus_expected

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and gpus_expected() is None
    assert devices.num_gpus() == 0
    out = subprocess.run([sys.executable, "-c", "import os; print(repr(os.environ["
                          "'CUDA_VISIBLE_DEVICES']))"], capture_output=True, text=True,
                         timeout=60).stdout
    assert out.strip() == "''"


@pytest.mark.parametrize("batch,replicas,warned", [(6, 2, True), (8, 2, False), (3, 1, False)])
def test_a_few_rows_per_replica_are_warned_about(batch, replicas, warned, caplog):
    import logging

    from tfpar.training.run import check_batch_sizes

    config = small_config(train=train_config(batch_size=batch), dist=DistConfig(strategy="mirrored"))
    with caplog.at_level(logging.WARNING, logger="tfpar.training.run"):
        check_batch_sizes(config, replicas)
    assert (f"--batch-size {batch} over {replicas} replicas is 3 rows each: too few to keep a "
            f"device busy; --batch-size 8 or more gives each 4" in caplog.text) == warned
    assert bool(caplog.records) == warned


# ---------------------------------------------------------------- GPU memory growth
def fake_gpu_host(monkeypatch, set_growth):
    """TensorFlow patched to report two physical GPUs; memory growth goes to ``set_growth``."""
    import tensorflow as tf

    gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(2)]
    real = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: list(gpus) if kind == "GPU" else real(kind))
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", set_growth)


def test_memory_growth_is_set_on_every_gpu_before_tensorflow_starts(monkeypatch, caplog):
    grown = []
    fake_gpu_host(monkeypatch, lambda gpu, on: grown.append((gpu.name, on)))
    devices.configure_gpus()
    assert grown == [("/physical_device:GPU:0", True), ("/physical_device:GPU:1", True)]
    assert not caplog.records


def test_memory_growth_after_tensorflow_started_is_one_warning_not_a_failure(monkeypatch,
                                                                             caplog):
    """Issue 42, failure 2: a notebook (or the GPU suite's conftest) that touched TensorFlow
    first made every GPU run raise here."""
    import logging

    def started(gpu, on):
        raise RuntimeError("Physical devices cannot be modified after being initialized")

    fake_gpu_host(monkeypatch, started)
    with caplog.at_level(logging.INFO, logger="tfpar.parallel.devices"):
        devices.configure_gpus()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [(
        "WARNING", "GPU memory growth not set: TensorFlow had started before tfpar configured "
        "the GPUs, so they keep TensorFlow's setting (nearly all memory mapped at start unless "
        "TF_FORCE_GPU_ALLOW_GROWTH=true was set before it started)")]


# ---------------------------------------------------------------- placement options
def test_the_placement_log_set_after_tensorflow_started_keeps_soft_placement():
    """TensorFlow 2.21: setting the placement log once the runtime has started (this test
    process's has: tests/conftest.py) turns the runtime's soft placement off, while
    ``tf.config.get_soft_device_placement()`` still says True; an op placed on a GPU it
    has no kernel for (or, here, on a GPU this host lacks) then fails. Found by the GPU
    suite's start-up under a faked GPU (tests/test_gpu_startup.py): its first mirrored
    run could not create a variable on /device:GPU:0."""
    import tensorflow as tf

    tf.config.set_soft_device_placement(True)
    devices.set_placement_options(log_placement=False, soft_placement=None)
    assert tf.config.get_soft_device_placement() is True
    with tf.device("/gpu:0"):  # no such device: soft placement puts it on the CPU
        variable = tf.Variable(1.0)
    assert variable.device.endswith("/device:CPU:0")
