"""``multi_worker``: synchronous data parallelism over processes (MultiWorkerMirroredStrategy).

Every worker process holds a copy of the variables and runs the same step as the
``mirrored`` plug-in; gradients, token counts and the global norm are all-reduced across
all replicas of all workers with collective ops over gRPC. The step math is the mirrored
one unchanged (:class:`~tfpar.parallel.distribute.DistributePlugin`), so a run matches
single-process ``mirrored`` with the same global batch (``verify_parallel.py
--strategies default,multi_worker:2``).

Devices. MultiWorkerMirroredStrategy uses every GPU of a worker, or, on a host without
GPUs, one CPU device per worker (``/job:worker/task:i/device:CPU:0``): more CPU replicas
mean more worker processes (``launch_local.py --workers N``), not ``--cpu-devices``,
which TF's strategy has no public way to honour and is refused.

Input. Every worker builds the same global batches and keeps the row slices of its own
replicas (``tfpar.parallel.rows.per_replica`` with the strategy's ``InputContext``:
``input_pipeline_id`` is the worker's place in the cluster, each worker owns
``num_replicas_in_sync / num_input_pipelines`` consecutive replica slots), so the union
over workers is each global batch exactly once.

The chief (the ``chief`` task, else worker 0) alone writes events, checkpoints, metrics
and the export. Saving a checkpoint is a collective every worker must join, so the other
workers save too, into temporary folders they delete (``tfpar.training.checkpoints``). Resuming
needs ``--model-dir`` on storage every worker can read (the same folder on one machine).

Keras 3's ``Model.fit`` is broken under this strategy (keras-team/keras#20585); this loop
only calls the model and ``optimizer.apply_gradients`` inside ``strategy.run``, which
works (checked with 2 processes: both workers end with identical weights).
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfpar.parallel.cluster.tf_config import ClusterConfig, check_port_free, require_cluster
from tfpar.parallel import devices as devices_lib
from tfpar.config import DistConfig, ModelConfig
from tfpar.errors import ClusterError, ConfigError, command
from tfpar.parallel.distribute import DistributePlugin

log = logging.getLogger(__name__)

# TensorFlow configures a process's collectives once, so the strategy is built once per
# process: building the plug-in again (same TF_CONFIG and options) returns the first one.
_BUILT: dict[tuple[str, str], "MultiWorkerPlugin"] = {}
COMMUNICATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


class MultiWorkerPlugin(DistributePlugin):
    """The mirrored step on a ``MultiWorkerMirroredStrategy``; knows its place in the cluster."""

    def __init__(self, strategy: tf.distribute.MultiWorkerMirroredStrategy,
                 config: ClusterConfig):
        local = list(strategy.extended.worker_devices)
        super().__init__("multi_worker", strategy, local)
        self.cluster = config
        # Every worker has the same local devices (TF's assumption too), so the job's
        # devices are this worker's, renamed for each task.
        kinds = [name.rsplit("/", 1)[-1] for name in local]
        self._all_devices = [f"/job:{job}/replica:0/task:{i}/{kind}"
                             for job in ("chief", "worker") for i in range(config.count(job))
                             for kind in kinds]

    @property
    def is_chief(self) -> bool:
        return self.cluster.is_chief

    @property
    def num_workers(self) -> int:
        return self.cluster.count("chief") + self.cluster.count("worker")

    @property
    def devices(self) -> list[str]:
        return self._all_devices

    @property
    def cluster_resolver(self):
        """The job's workers stop together (one worker alone has no one to agree with)."""
        return self.strategy.cluster_resolver if self.num_workers > 1 else None

    def describe(self) -> str:
        return (f"multi_worker: {self.num_replicas} replica(s) on {self.num_workers} worker(s); "
                f"this is {self.cluster.task_name} at {self.cluster.address}"
                f"{' (chief)' if self.is_chief else ''}, devices {', '.join(self._devices)}")


def communication_options(name: str) -> tf.distribute.experimental.CommunicationOptions:
    """``--communication`` → the collectives' implementation.

    Raises:
      ConfigError: nccl on a host without GPUs.
    """
    if name == "nccl" and devices_lib.num_gpus() == 0:
        raise ConfigError("--communication nccl needs GPUs on every worker, but this worker "
                          "has none; use --communication auto or ring")
    return tf.distribute.experimental.CommunicationOptions(implementation=COMMUNICATION[name])


def build_multi_worker(dist: DistConfig, model: ModelConfig | None = None
                       ) -> MultiWorkerPlugin:
    """``MultiWorkerMirroredStrategy`` over the cluster ``TF_CONFIG`` describes.

    Raises:
      ClusterError: TF_CONFIG is unset or malformed, lacks workers, or this task's port is
        taken.
      ConfigError: --devices, --cpu-devices > 1 without GPUs, or nccl without GPUs.
    """
    config = require_cluster("multi_worker", source=dist.cluster)
    if dist.devices:
        raise ConfigError(f"--devices {','.join(dist.devices)}: multi_worker uses every GPU of "
                          "each worker (or its CPU); choose GPUs with CUDA_VISIBLE_DEVICES")
    if dist.cpu_devices > 1 and devices_lib.num_gpus() == 0:
        raise ConfigError(
            f"--cpu-devices {dist.cpu_devices}: multi_worker runs one replica per worker on a "
            "host without GPUs (MultiWorkerMirroredStrategy uses only CPU:0); start more "
            f"workers instead: {command('tfpar-launch', '--workers N')}")
    options = communication_options(dist.communication)
    key = (config.to_json(), dist.communication)
    if key in _BUILT:
        return _BUILT[key]
    # The strategy starts this task's gRPC server; a taken port must fail here, clearly.
    check_port_free(config.address)
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except RuntimeError as e:
        if "program startup" not in str(e):
            raise
        raise ClusterError("multi_worker must start before TensorFlow runs anything in this "
                           "process (its collectives are configured at start-up); build the "
                           "strategy first") from None
    _BUILT[key] = MultiWorkerPlugin(strategy, config)
    return _BUILT[key]
