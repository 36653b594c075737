"""Strategies by name; :func:`build_strategy` is the one way to get a synchronous one.

Each synchronous plug-in lives in its own module and registers a builder here (a new
strategy is one module and one line in :data:`STRATEGIES`). "No distribution" is the
``default`` plug-in (TF's default strategy), never ``None``, so callers never branch.
Asynchronous parameter-server training is its own path (:data:`ASYNCHRONOUS`): the
training run picks it before any plug-in is built.
"""

from __future__ import annotations

from typing import Callable

from tfpar.config import DistConfig
from tfpar.errors import ConfigError
from tfpar.parallel import distribute
from tfpar.parallel import multi_worker
from tfpar.parallel import parallel_do
from tfpar.parallel import parameter_server
from tfpar.parallel.pipeline import plugin as pipeline
from tfpar.parallel.pipeline import stages as pipeline_stages
from tfpar.parallel import tower
from tfpar.parallel.base import StrategyPlugin

# name -> builder(DistConfig) -> StrategyPlugin
STRATEGIES: dict[str, Callable[[DistConfig], StrategyPlugin]] = {
    "default": distribute.build_default,
    "one_device": distribute.build_one_device,
    "mirrored": distribute.build_mirrored,
    "tower": tower.build_tower,
    "pipeline": pipeline.build_pipeline,
    "multi_worker": multi_worker.build_multi_worker,
    "parallel_do": parallel_do.build_parallel_do,
}
# Strategies that train asynchronously, with no synchronous update to place (their own
# loop, tfpar.training.loop.AsyncLoop): name -> builder(DistConfig) of the coordinator.
ASYNCHRONOUS = {
    "parameter_server": parameter_server.build_coordinator,
}


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
    return builder(dist)


def cpu_devices_needed(dist: DistConfig) -> int:
    """Logical CPU devices to create before TF starts, for this distribution config."""
    if dist.cpu_devices:
        return dist.cpu_devices
    needed = 1
    for name in dist.devices + pipeline_stages.stage_device_names(dist.stages):
        if name.strip().lower().lstrip("/").startswith("cpu:"):
            needed = max(needed, int(name.rsplit(":", 1)[1]) + 1)
    if dist.strategy in ("mirrored", "tower", "pipeline", "parallel_do"):
        needed = max(needed, 2)
    return needed
