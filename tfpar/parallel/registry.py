"""Strategies by name: the one list of them (flags, tools and tests read it here).

:func:`build_strategy` is the one way to get a synchronous plug-in, :func:`build_for` the
one way a command gets what runs its config (the plug-in, or the asynchronous
coordinator). Each synchronous plug-in lives in its own module and registers a builder
here (a new strategy is one module and one line in :data:`STRATEGIES`). "No distribution"
is the ``default`` plug-in (TF's default strategy), never ``None``, so callers never
branch. Asynchronous parameter-server training is its own path (:data:`ASYNCHRONOUS`):
the training run picks it before any plug-in is built.

Placement is decided when a plug-in is built, from the distribution config and the model
config it will place (the pipeline keeps a tied embedding with the softmax), so every
command that builds one (training, evaluation, the side-car evaluator) places the model
alike, and what ``describe()`` logs is what runs. Export and generation build no
plug-in: they rebuild the model outside any strategy (``tfpar.serving.export``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Callable

from tfpar.config import Config, DistConfig, ModelConfig
from tfpar.errors import ConfigError

if TYPE_CHECKING:
    from tfpar.parallel.base import StrategyPlugin


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A strategy's builder and the traits a run's set-up and the tools read before
    TensorFlow starts (logical devices and thread pools are fixed when its runtime
    initialises)."""

    # (DistConfig, ModelConfig or None) -> the plug-in (synchronous) or the coordinator
    # (asynchronous), its placement decided for that model.
    build: Callable[[DistConfig, ModelConfig | None], Any]
    # What a run's N counts: "" (one device), "devices" (data-parallel replicas on N
    # devices), "stages" (the model cut into N stages on N devices), "workers" (N
    # processes of a cluster).
    over: str = ""
    # Logical CPU devices it needs at least on a host without GPUs (its replicas or
    # stages); more when --devices or --stages name a higher one.
    min_cpu_devices: int = 1
    # Its devices work at once (replicas, stages): on N >= 2 logical CPU devices each op
    # gets the host's cores / N threads (tfpar.parallel.devices.intra_op_threads).
    splits_threads: bool = False
    # Cluster tasks that only serve (asynchronous training's worker and ps tasks):
    # DistConfig -> this process's task (``describe()``, ``serve()``), or None for the
    # task that trains. None: every task trains.
    server_task: Callable[[DistConfig], Any] | None = None
    # Config -> None, or ConfigError for run settings it cannot honour; run by
    # :func:`build_for` before anything is built. None: it honours every setting.
    check: Callable[[Config], None] | None = None

    @property
    def cluster(self) -> bool:
        """Processes of a cluster (TF_CONFIG or a Slurm step): one CPU device per task,
        the collective runtime configured by the strategy itself; not run in one
        process."""
        return self.over == "workers"


# The builders import their plug-in's module when called: the registry itself imports no
# TensorFlow, so the flags' help and the tools read it before TensorFlow starts.
def _lazy(module: str, function: str) -> Callable:
    """``module.function``, imported at its first call."""
    def call(*args):
        return getattr(importlib.import_module(module), function)(*args)

    call.__name__ = call.__qualname__ = function
    return call


_DISTRIBUTE = "tfpar.parallel.distribute"
_PS = "tfpar.parallel.parameter_server"
_default = _lazy(_DISTRIBUTE, "build_default")
_one_device = _lazy(_DISTRIBUTE, "build_one_device")
_mirrored = _lazy(_DISTRIBUTE, "build_mirrored")
_tower = _lazy("tfpar.parallel.tower", "build_tower")
_pipeline = _lazy("tfpar.parallel.pipeline.plugin", "build_pipeline")
_multi_worker = _lazy("tfpar.parallel.multi_worker", "build_multi_worker")
_parallel_do = _lazy("tfpar.parallel.parallel_do", "build_parallel_do")
_coordinator = _lazy(_PS, "build_coordinator")
_parameter_server_task = _lazy(_PS, "server_task")
_parameter_server_check = _lazy(_PS, "check_config")


# name -> Strategy. A new synchronous strategy: its module, and one line here.
STRATEGIES: dict[str, Strategy] = {
    "default": Strategy(_default),
    "one_device": Strategy(_one_device),
    "mirrored": Strategy(_mirrored, "devices", min_cpu_devices=2, splits_threads=True),
    "tower": Strategy(_tower, "devices", min_cpu_devices=2, splits_threads=True),
    "pipeline": Strategy(_pipeline, "stages", min_cpu_devices=2, splits_threads=True),
    "multi_worker": Strategy(_multi_worker, "workers"),
    "parallel_do": Strategy(_parallel_do, "devices", min_cpu_devices=2, splits_threads=True),
}
# Strategies that train asynchronously, with no synchronous update to place (their own
# loop, tfpar.training.async_loop.AsyncLoop); ``build`` makes the coordinator.
ASYNCHRONOUS: dict[str, Strategy] = {
    "parameter_server": Strategy(_coordinator, "workers", server_task=_parameter_server_task,
                                 check=_parameter_server_check),
}


def names() -> list[str]:
    """Every registered strategy, synchronous ones first."""
    return list(STRATEGIES) + list(ASYNCHRONOUS)


def traits(name: str) -> Strategy:
    """The registered strategy ``name`` (an unknown name: one with no needs; building it
    is what refuses it, with the list of known ones)."""
    return STRATEGIES.get(name) or ASYNCHRONOUS.get(name) or Strategy(build_strategy)


def is_asynchronous(name: str) -> bool:
    """Whether ``name`` trains asynchronously (its own loop, no synchronous plug-in)."""
    return name in ASYNCHRONOUS


def _unknown(name: str) -> ConfigError:
    return ConfigError(f"unknown strategy {name!r}; expected one of: {', '.join(names())}")


def build_strategy(dist: DistConfig, model: ModelConfig | None = None) -> StrategyPlugin:
    """Builds the plug-in named by ``dist.strategy``, its placement decided for ``model``
    (None: a model whose placement needs nothing of its config, i.e. an untied
    embedding; a command that runs a whole config uses :func:`build_for`).

    Raises:
      ConfigError: the name is unknown (the message lists the known ones), or
        asynchronous.
    """
    if dist.strategy in ASYNCHRONOUS:
        raise ConfigError(f"{dist.strategy} trains asynchronously: it has no synchronous "
                          f"step; use one of: {', '.join(STRATEGIES)}")
    if dist.strategy not in STRATEGIES:
        raise _unknown(dist.strategy)
    return STRATEGIES[dist.strategy].build(dist, model)


def build_for(config: Config):
    """What runs ``config``: the synchronous plug-in, or the coordinator of asynchronous
    training, built for ``config.dist`` with its placement decided for ``config.model``
    (nothing changes it later: log its ``describe()`` any time after this), once the
    strategy's ``check`` has accepted the run's settings.

    Raises:
      ConfigError: an unknown strategy name, or settings the strategy cannot honour.
    """
    check = traits(config.dist.strategy).check
    if check is not None:
        check(config)
    if config.dist.strategy in ASYNCHRONOUS:
        return ASYNCHRONOUS[config.dist.strategy].build(config.dist, config.model)
    return build_strategy(config.dist, config.model)


def server_task(dist: DistConfig):
    """This process's serving task when ``dist``'s strategy has tasks that only serve
    and this is one of them (it then serves instead of training), else None."""
    serve = traits(dist.strategy).server_task
    return serve(dist) if serve is not None else None


def cpu_devices_needed(dist: DistConfig) -> int:
    """Logical CPU devices to create before TF starts, for this distribution config (one
    per task for a cluster strategy)."""
    if traits(dist.strategy).cluster:
        return 1
    if dist.cpu_devices:
        return dist.cpu_devices
    from tfpar.parallel.pipeline import stages  # (see the builders above)

    needed = 1
    for name in dist.devices + stages.stage_device_names(dist.stages):
        if name.strip().lower().lstrip("/").startswith("cpu:"):
            needed = max(needed, int(name.rsplit(":", 1)[1]) + 1)
    return max(needed, traits(dist.strategy).min_cpu_devices)


def intra_op_threads(dist: DistConfig, cpu_devices: int) -> int:
    """Threads one op may use for this run (0: TensorFlow's default), as
    :func:`tfpar.parallel.devices.intra_op_threads` decides it for this strategy."""
    from tfpar.parallel import devices  # (see the builders above)

    return devices.intra_op_threads(dist, cpu_devices,
                                    split=traits(dist.strategy).splits_threads)
