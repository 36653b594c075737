"""Strategies by name; :func:`build_strategy` is the one way to get a synchronous one.

Each synchronous plug-in lives in its own module and registers a builder here (a new
strategy is one module and one line in :data:`STRATEGIES`). "No distribution" is the
``default`` plug-in (TF's default strategy), never ``None``, so callers never branch.
Asynchronous parameter-server training is its own path (:data:`ASYNCHRONOUS`): the
training run picks it before any plug-in is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tfpar.config import DistConfig
from tfpar.errors import ConfigError
from tfpar.parallel import devices, distribute
from tfpar.parallel import multi_worker
from tfpar.parallel import parallel_do
from tfpar.parallel import parameter_server
from tfpar.parallel.pipeline import plugin as pipeline
from tfpar.parallel.pipeline import stages as pipeline_stages
from tfpar.parallel import tower
from tfpar.parallel.base import StrategyPlugin


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A strategy's builder and the traits a run's set-up reads before TensorFlow starts
    (logical devices and thread pools are fixed when its runtime initialises)."""

    # DistConfig -> the plug-in (synchronous) or the coordinator (asynchronous).
    build: Callable[[DistConfig], Any]
    # Logical CPU devices it needs at least on a host without GPUs (its replicas or
    # stages); more when --devices or --stages name a higher one.
    min_cpu_devices: int = 1
    # Its devices work at once (replicas, stages): on N >= 2 logical CPU devices each op
    # gets the host's cores / N threads (tfpar.parallel.devices.intra_op_threads).
    splits_threads: bool = False
    # Processes of a cluster (TF_CONFIG or a Slurm step): one CPU device per task, and
    # the collective runtime is configured by the strategy itself.
    cluster: bool = False


# name -> Strategy. A new synchronous strategy: its module, and one line here.
STRATEGIES: dict[str, Strategy] = {
    "default": Strategy(distribute.build_default),
    "one_device": Strategy(distribute.build_one_device),
    "mirrored": Strategy(distribute.build_mirrored, min_cpu_devices=2, splits_threads=True),
    "tower": Strategy(tower.build_tower, min_cpu_devices=2, splits_threads=True),
    "pipeline": Strategy(pipeline.build_pipeline, min_cpu_devices=2, splits_threads=True),
    "multi_worker": Strategy(multi_worker.build_multi_worker, cluster=True),
    "parallel_do": Strategy(parallel_do.build_parallel_do, min_cpu_devices=2,
                            splits_threads=True),
}
# Strategies that train asynchronously, with no synchronous update to place (their own
# loop, tfpar.training.async_loop.AsyncLoop); ``build`` makes the coordinator.
ASYNCHRONOUS: dict[str, Strategy] = {
    "parameter_server": Strategy(parameter_server.build_coordinator, cluster=True),
}


def traits(name: str) -> Strategy:
    """The registered strategy ``name`` (an unknown name: one with no needs; building it
    is what refuses it, with the list of known ones)."""
    return STRATEGIES.get(name) or ASYNCHRONOUS.get(name) or Strategy(build_strategy)


def build_strategy(dist: DistConfig) -> StrategyPlugin:
    """Builds the plug-in named by ``dist.strategy``.

    Raises:
      ConfigError: the name is unknown (the message lists the known ones).
    """
    if dist.strategy in ASYNCHRONOUS:
        raise ConfigError(f"{dist.strategy} trains asynchronously: it has no synchronous "
                          f"step; use one of: {', '.join(STRATEGIES)}")
    try:
        builder = STRATEGIES[dist.strategy]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {dist.strategy!r}; expected one of: "
            f"{', '.join(list(STRATEGIES) + list(ASYNCHRONOUS))}"
        ) from None
    return builder.build(dist)


def cpu_devices_needed(dist: DistConfig) -> int:
    """Logical CPU devices to create before TF starts, for this distribution config (one
    per task for a cluster strategy)."""
    if traits(dist.strategy).cluster:
        return 1
    if dist.cpu_devices:
        return dist.cpu_devices
    needed = 1
    for name in dist.devices + pipeline_stages.stage_device_names(dist.stages):
        if name.strip().lower().lstrip("/").startswith("cpu:"):
            needed = max(needed, int(name.rsplit(":", 1)[1]) + 1)
    return max(needed, traits(dist.strategy).min_cpu_devices)


def intra_op_threads(dist: DistConfig, cpu_devices: int) -> int:
    """Threads one op may use for this run (0: TensorFlow's default), as
    :func:`tfpar.parallel.devices.intra_op_threads` decides it for this strategy."""
    return devices.intra_op_threads(dist, cpu_devices,
                                    split=traits(dist.strategy).splits_threads)
