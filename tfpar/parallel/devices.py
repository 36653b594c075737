"""Devices: logical CPU devices, device-name resolution and placement options.

A host without GPUs can still run every multi-device path: TensorFlow can split the one
physical CPU into N *logical* devices (``/cpu:0`` … ``/cpu:N-1``) that share its cores.
They run the same kernels and the same communication code as separate GPUs would, so
multi-device numerics and placement are exercised for real; only the speed-up is not.
This must happen before TensorFlow initialises its devices, so scripts call
:func:`configure_cpu_devices` first thing, and ``tests/conftest.py`` does it before any test.
"""

from __future__ import annotations

import logging
import os
import re

import tensorflow as tf

from tfpar.errors import ConfigError, DeviceError
from tfpar.parallel.host import gpus_expected

log = logging.getLogger(__name__)

_SHORT = re.compile(r"^/?(?:device:)?(cpu|gpu|tpu):(\d+)$", re.IGNORECASE)


def configure_cpu_devices(
        count: int, *, too_late: str = "set --cpu-devices before anything runs on TensorFlow"
) -> int:
    """Splits the host CPU into ``count`` logical devices and returns how many exist.

    Safe to call more than once: when TensorFlow has already initialised its devices,
    the existing split is kept if it has at least ``count`` devices.

    Raises:
      DeviceError: the runtime is already initialised with fewer CPU devices (the
        message ends with ``too_late``: what to do instead).
    """
    cpus = tf.config.list_physical_devices("CPU")
    try:
        current = tf.config.get_logical_device_configuration(cpus[0]) or [None]
        if len(current) < count:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
            )
    except RuntimeError:
        pass  # Already initialised: what exists is checked below.
    existing = len(tf.config.list_logical_devices("CPU"))
    if existing < count:
        raise DeviceError(
            f"{count} logical CPU devices were asked for, but TensorFlow was already "
            f"initialised with {existing}; {too_late}")
    return existing


def configure_gpus(cpu_only: bool = False) -> None:
    """GPU set-up, before TensorFlow initialises.

    ``cpu_only`` (``--cpu-only``): every GPU hidden, the run uses CPUs. Otherwise each GPU
    grows its memory as needed (TensorFlow's default maps nearly all of it at start), and
    a host that should have GPUs (:func:`~tfpar.parallel.host.gpus_expected`) where
    TensorFlow found none fails here instead of training on CPUs unnoticed.

    Raises:
      DeviceError: GPUs expected, none usable.
    """
    if cpu_only:
        try:
            tf.config.set_visible_devices([], "GPU")
        except RuntimeError:  # TensorFlow had started (a second run in one process)
            log.warning("--cpu-only comes after TensorFlow started: the GPUs stay visible")
            return
        log.info("--cpu-only: GPUs hidden, training on CPUs")
        return
    gpus = tf.config.list_physical_devices("GPU")
    set_memory_growth(gpus)
    if not gpus:
        evidence = gpus_expected()
        if evidence:
            raise DeviceError(
                f"this host should have GPUs ({evidence}) but TensorFlow found none; its "
                "log lines above say what failed (driver, CUDA libraries: pip install "
                "'tfpar[gpu]' brings them); pass --cpu-only to train on CPUs")


def set_memory_growth(gpus) -> None:
    """Lets each GPU in ``gpus`` grow its memory as needed, where TensorFlow still allows it.

    TensorFlow fixes GPU memory when its runtime starts: once anything has run (a notebook
    cell, a test's conftest, an earlier run in this process), ``set_memory_growth`` raises
    RuntimeError. The run can still go on with TensorFlow's own setting, so that is one
    warning, not a failure.
    """
    try:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError:
        log.warning(
            "GPU memory growth not set: TensorFlow had started before tfpar configured the "
            "GPUs, so they keep TensorFlow's setting (nearly all memory mapped at start "
            "unless TF_FORCE_GPU_ALLOW_GROWTH=true was set before it started)")


def num_gpus() -> int:
    return len(tf.config.list_physical_devices("GPU"))


def canonical(name: str) -> str:
    """'/gpu:1', 'GPU:1', '/device:GPU:1' → '/device:GPU:1'; full names pass through."""
    m = _SHORT.match(name.strip())
    if m:
        return f"/device:{m.group(1).upper()}:{m.group(2)}"
    return name.strip()


def same_device(a: str, b: str) -> bool:
    """Whether two device names (any spelling, any job prefix) are the same device type
    and index: '/cpu:1' and '/job:localhost/replica:0/task:0/device:CPU:1' are."""
    x, y = tf.DeviceSpec.from_string(canonical(a)), tf.DeviceSpec.from_string(canonical(b))
    return (x.device_type, x.device_index) == (y.device_type, y.device_index)


def available_devices() -> list[str]:
    """Short names of every logical device, e.g. ['/cpu:0', '/cpu:1', '/gpu:0']."""
    names = []
    for d in tf.config.list_logical_devices():
        kind, index = d.name.split("device:")[-1].split(":")
        names.append(f"/{kind.lower()}:{index}")
    return names


def resolve_devices(requested: tuple[str, ...]) -> list[str]:
    """Checks that every requested device exists and returns canonical names.

    Raises:
      DeviceError: a device does not exist; the message lists the devices that do.
    """
    have = {canonical(n).lower(): n for n in available_devices()}
    out = []
    for name in requested:
        if not _SHORT.match(name.strip()):
            raise DeviceError(f"cannot parse device name {name!r}; use a form like /cpu:0 or /gpu:1")
        if canonical(name).lower() not in have:
            raise DeviceError(
                f"device {name!r} does not exist on this host; available: "
                f"{', '.join(available_devices())} (split the CPU with --cpu-devices N)"
            )
        out.append(canonical(name))
    if len(set(out)) != len(out):
        raise DeviceError(f"--devices lists a device twice: {','.join(requested)}")
    return out


def default_devices(count: int) -> list[str]:
    """``count`` devices for a multi-device strategy: GPUs when there are enough, else
    logical CPUs (which must have been configured)."""
    gpus = num_gpus()
    if gpus >= count:
        return [f"/device:GPU:{i}" for i in range(count)]
    cpus = len(tf.config.list_logical_devices("CPU"))
    if cpus < count:
        raise DeviceError(
            f"{count} devices were asked for but this host has {gpus} GPUs and {cpus} logical "
            f"CPU devices; pass --cpu-devices {count}"
        )
    return [f"/device:CPU:{i}" for i in range(count)]


def host_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def intra_op_threads(dist, cpu_devices: int, *, split: bool) -> int:
    """Threads one op may use for this run; 0 leaves TensorFlow's default (every core).

    ``dist.intra_op_threads`` when set. Otherwise, when a strategy whose devices work at
    once (``split``: the registry's ``splits_threads``; mirrored, tower, pipeline,
    parallel_do) runs on ``cpu_devices`` >= 2 logical CPU devices, the host's cores
    divided among them: logical devices share TF's one thread pool, so with the default
    each replica's large matmuls take every core and the replicas (or pipeline stages)
    queue behind each other, where with a share each they run side by side, overlapping
    one replica's sequential recurrence with another's matmuls.
    """
    if dist.intra_op_threads:
        return dist.intra_op_threads
    if split and cpu_devices >= 2 and num_gpus() == 0:
        return max(1, host_cores() // cpu_devices)
    return 0


def configure_threads(intra_op: int, *, requested: bool = True) -> None:
    """Sets TF's intra-op pool size (0: TF's default). Must run before TF initialises;
    afterwards the pools are fixed and a different size is ignored, with a warning when
    the user ``requested`` it (``--intra-op-threads``)."""
    if not intra_op or tf.config.threading.get_intra_op_parallelism_threads() == intra_op:
        return
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
        log.info("intra-op threads: %d (%d cores)", intra_op, host_cores())
    except RuntimeError:
        (log.warning if requested else log.debug)(
            "intra-op threads stay at TensorFlow's setting: it was already initialised "
            "when %d was asked for", intra_op)


def set_placement_options(*, log_placement: bool, soft_placement: bool | None) -> None:
    """TensorFlow's placement log and soft placement (``allow_soft_placement`` in TF1;
    None leaves TensorFlow's setting, on by default)."""
    tf.debugging.set_log_device_placement(log_placement)
    # Set once TensorFlow's runtime has started (a notebook, the GPU suite after its
    # conftest, a second run in one process), the placement log turns the runtime's soft
    # placement off while tf.config.get_soft_device_placement() still says on (TF 2.21):
    # an op with no GPU kernel placed on a GPU would then fail. Setting soft placement
    # after the log puts the runtime back in step with what TensorFlow reports.
    tf.config.set_soft_device_placement(
        tf.config.get_soft_device_placement() if soft_placement is None else soft_placement)


def data_parallel_devices(dist, default_count: int = 2) -> list[str]:
    """The devices of a one-process data-parallel strategy (mirrored, tower,
    parallel_do): ``--devices``; else every GPU (one GPU is one replica); else, on a host
    without GPUs, ``--cpu-devices`` logical CPUs (default 2).

    Raises:
      ConfigError: ``--cpu-devices`` on a host with GPUs (the GPUs would be left idle;
        that choice is made by hiding them, ``CUDA_VISIBLE_DEVICES=``).
    """
    if dist.devices:
        return resolve_devices(dist.devices)
    gpus = num_gpus()
    if gpus and dist.cpu_devices:
        raise ConfigError(
            f"--cpu-devices {dist.cpu_devices}: this host has {gpus} GPU(s), which "
            f"--strategy {dist.strategy} trains on; drop --cpu-devices, name devices with "
            "--devices, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on logical CPUs")
    if gpus:
        names = default_devices(gpus)
        log.info("using %d GPU(s): %s (%d replica(s))", gpus, ", ".join(names), gpus)
        return names
    count = dist.cpu_devices or default_count
    names = default_devices(count)
    log.info("no GPUs: using %d logical CPU devices (%s)", count, ", ".join(names))
    return names
