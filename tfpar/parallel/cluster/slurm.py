"""A multi_worker cluster from a Slurm job step, for ``srun``-started tasks without
``TF_CONFIG``.

``srun`` gives every task its rank (``SLURM_PROCID``), the step's task count, nodes and
tasks per node; TensorFlow's ``SlurmClusterResolver`` turns them into a cluster (one
``worker`` per task, task k of a node on port ``port_base + k``, its GPUs split among the
node's tasks through ``CUDA_VISIBLE_DEVICES``). :func:`slurm_cluster` returns it;
``tfpar.parallel.cluster.tf_config.require_cluster`` writes it as the ``TF_CONFIG``
every other part of tfpar reads. The node list is expanded
by the resolver itself (``node[1-4]``), so no ``scontrol`` is needed.

Environment: ``TFPAR_SLURM_PORT_BASE`` (default 8888) moves the ports.
"""

from __future__ import annotations

import os
from typing import Mapping

from tfpar.errors import ClusterError
from tfpar.parallel.host import gpus_expected

# The variables srun sets for every task of a job step.
STEP_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
                  "SLURM_STEP_TASKS_PER_NODE")
DEFAULT_PORT_BASE = 8888


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of a Slurm job step (started by ``srun``)."""
    return all(name in environ for name in STEP_VARIABLES)


def slurm_cluster(strategy: str, environ: Mapping[str, str] | None = None
                  ) -> tuple[dict[str, list[str]], str, int]:
    """The cluster of this Slurm task's job step, every task a ``worker``, and this
    task's (type, index).

    Call before TensorFlow initialises: on GPU nodes the resolver gives each task its
    share of the node's GPUs (``CUDA_VISIBLE_DEVICES``).

    Raises:
      ClusterError: not a multi_worker run, or a step the resolver cannot lay out.
    """
    environ = os.environ if environ is None else environ
    if strategy != "multi_worker":
        raise ClusterError(f"--strategy {strategy} under Slurm needs TF_CONFIG (chief, worker "
                           "and ps roles); only multi_worker builds its cluster from srun")
    text = environ.get("TFPAR_SLURM_PORT_BASE", str(DEFAULT_PORT_BASE))
    try:
        port_base = int(text)
    except ValueError:
        raise ClusterError(f"TFPAR_SLURM_PORT_BASE {text!r} is not a port number") from None
    import tensorflow as tf

    SlurmClusterResolver = tf.distribute.cluster_resolver.SlurmClusterResolver

    gpu = {}
    if gpus_expected(environ) is None:  # CPU nodes: no GPUs to split (the resolver
        # divides by the GPUs per task, so it is given one "GPU" per task, not applied)
        tasks = max(int(t.split("(")[0]) for t in
                    environ["SLURM_STEP_TASKS_PER_NODE"].split(","))
        gpu = dict(gpus_per_node=tasks, gpus_per_task=1, auto_set_gpu=False)
    try:
        resolver = SlurmClusterResolver(port_base=port_base, **gpu)
        cluster = resolver.cluster_spec().as_dict()
        task_type, task_id = resolver.get_task_info()
    except (RuntimeError, ValueError, KeyError) as e:
        raise ClusterError(f"cannot lay out the Slurm job step as a cluster: {e}") from None
    return cluster, task_type, int(task_id)
