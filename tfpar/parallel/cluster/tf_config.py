"""``TF_CONFIG``: one process's place in a TensorFlow cluster, checked per strategy; ports.

Every process of a TensorFlow cluster gets the same cluster and its own task in the
``TF_CONFIG`` environment variable (TensorFlow's own format)::

    {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
     "task": {"type": "worker", "index": 1}}

Roles per strategy:

``multi_worker`` (synchronous, ``MultiWorkerMirroredStrategy``)
    ``worker`` tasks, optionally one ``chief``; every task trains, in lockstep. The chief
    is the ``chief`` task or, when there is none, worker 0 (what ``launch_local.py``
    does). Only the chief writes events, checkpoints, metrics and the export.
``parameter_server`` (asynchronous, ``ParameterServerStrategy``)
    one ``chief`` (the coordinator: runs the loop, schedules steps, evaluates and writes
    everything), ``worker`` tasks (compute steps) and ``ps`` tasks (hold the variables).
    Workers and ps tasks only serve until they are stopped.

Either may list one ``evaluator`` task (Kubernetes' TFJob does): a side-car that is no
part of the training cluster (TensorFlow's strategies leave it out). It evaluates each new
checkpoint of the model dir (:mod:`tfpar.training.sidecar`).

:func:`require_cluster` reads and checks ``TF_CONFIG`` for a strategy; every problem is
a one-line :class:`~tfpar.errors.ClusterError`. :func:`check_port_free` and
:class:`PortReservation` check, pick and hold ports. Standard library only (no TensorFlow): the CLI
imports this module before TensorFlow starts.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import socket
from typing import Mapping, Sequence

from tfpar.errors import ClusterError, command

LOOPBACK = "127.0.0.1"
# Jobs each cluster strategy needs and accepts, in the order tasks are listed.
JOBS = {
    "multi_worker": {"required": ("worker",), "allowed": ("chief", "worker", "evaluator")},
    "parameter_server": {"required": ("chief", "worker", "ps"),
                         "allowed": ("chief", "worker", "ps", "evaluator")},
}
# The task type of a side-car evaluator (TensorFlow's and TFJob's name).
EVALUATOR = "evaluator"
CLUSTER_STRATEGIES = tuple(JOBS)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """One process's view of the cluster, as ``TF_CONFIG`` gives it."""

    # job name -> "host:port" of each task, e.g. {"worker": ("127.0.0.1:2222", ...)}.
    cluster: dict[str, tuple[str, ...]]
    # This process's job ("chief", "worker" or "ps") and index in it.
    task_type: str
    task_index: int

    @property
    def address(self) -> str:
        """This task's "host:port"."""
        return self.cluster[self.task_type][self.task_index]

    @property
    def training_cluster(self) -> dict[str, tuple[str, ...]]:
        """The cluster without its side-car ``evaluator``: the tasks that train (a
        coordinator told of the evaluator would wait for its server, which never starts)."""
        return {job: a for job, a in self.cluster.items() if job != EVALUATOR}

    def count(self, job: str) -> int:
        return len(self.cluster.get(job, ()))

    @property
    def is_chief(self) -> bool:
        """The ``chief`` task, or worker 0 when the cluster has no chief."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def task_name(self) -> str:
        return f"{self.task_type} {self.task_index}"

    def to_json(self) -> str:
        return tf_config_json(self.cluster, self.task_type, self.task_index)


def tf_config_json(cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int) -> str:
    """The ``TF_CONFIG`` value of one task."""
    return json.dumps({"cluster": {job: list(addresses) for job, addresses in cluster.items()},
                       "task": {"type": task_type, "index": task_index}})


def split_address(address: str) -> tuple[str, int]:
    """"host:port" → (host, port).

    Raises:
      ClusterError: not host:port with a port in 1..65535.
    """
    host, sep, port_text = str(address).rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ClusterError(f"TF_CONFIG address {address!r} is not host:port with a port in "
                           "1..65535, e.g. 127.0.0.1:2222")
    return host, int(port_text)


def parse_tf_config(text: str) -> ClusterConfig:
    """Parses and checks one ``TF_CONFIG`` value (any strategy).

    Raises:
      ClusterError: not JSON, no ``cluster`` or ``task``, a job that is not a list of
        host:port addresses, a task whose type is not in the cluster, or a task index out
        of range.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({e.msg} at character {e.pos}); "
                           'expected {"cluster": {...}, "task": {"type": ..., "index": ...}}'
                           ) from None
    if not isinstance(data, dict):
        raise ClusterError(f"TF_CONFIG must be a JSON object with cluster and task, got "
                           f"{type(data).__name__}")
    cluster = data.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterError('TF_CONFIG has no "cluster": give every job\'s addresses, e.g. '
                           '"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}')
    jobs: dict[str, tuple[str, ...]] = {}
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or not addresses:
            raise ClusterError(f"TF_CONFIG cluster job {job!r} must be a non-empty list of "
                               f"host:port addresses, got {addresses!r}")
        for address in addresses:
            split_address(address)
        jobs[job] = tuple(addresses)
    task = data.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ClusterError('TF_CONFIG has no "task" with a type and an index; e.g. '
                           '"task": {"type": "worker", "index": 0}')
    task_type, index = task["type"], task["index"]
    if task_type not in jobs:
        raise ClusterError(f"TF_CONFIG task type {task_type!r} is not a job of the cluster "
                           f"({', '.join(jobs)})")
    count = len(jobs[task_type])
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise ClusterError(f"TF_CONFIG task index {index!r} is out of range: job {task_type!r} "
                           f"has {count} task(s), so 0..{count - 1}")
    return ClusterConfig(jobs, task_type, index)


def check_jobs(config: ClusterConfig, strategy: str) -> None:
    """Checks that the cluster has the jobs ``strategy`` needs (see the module docstring).

    Raises:
      ClusterError: a missing job (e.g. no chief for parameter_server), an extra job, more
        than one chief, or this task in a job the strategy does not use.
    """
    jobs = JOBS[strategy]
    have = ", ".join(config.cluster)
    for job in jobs["required"]:
        if job not in config.cluster:
            what = {"chief": "a 'chief' task (the coordinator)",
                    "worker": "one or more 'worker' tasks (they compute the steps)",
                    "ps": "one or more 'ps' tasks (they hold the variables)"}[job]
            raise ClusterError(f"--strategy {strategy} needs {what}, but TF_CONFIG's cluster has "
                               f"only: {have}")
    for job in config.cluster:
        if job not in jobs["allowed"]:
            raise ClusterError(f"--strategy {strategy} has no {job!r} tasks, but TF_CONFIG's "
                               f"cluster lists some; use only: {', '.join(jobs['allowed'])}")
    for job in ("chief", EVALUATOR):
        if config.count(job) > 1:
            raise ClusterError(f"TF_CONFIG lists {config.count(job)} {job} tasks; a cluster has "
                               f"at most one {job}")


def is_evaluator(strategy: str, environ: Mapping[str, str] | None = None,
                 source: str = "auto") -> bool:
    """Whether this process is the side-car ``evaluator`` task of ``strategy``'s cluster.

    Raises:
      ClusterError: ``TF_CONFIG`` is wrong for ``strategy`` (a cluster strategy), or its
        task is an evaluator but ``strategy`` has no cluster.
    """
    env = os.environ if environ is None else environ
    if strategy in JOBS:
        return require_cluster(strategy, env, source).task_type == EVALUATOR
    text = env.get("TF_CONFIG", "").strip()
    try:
        task = json.loads(text).get("task", {}) if text else {}
    except (json.JSONDecodeError, AttributeError):
        return False  # a strategy without a cluster does not read TF_CONFIG
    if isinstance(task, dict) and task.get("type") == EVALUATOR:
        raise ClusterError(f"TF_CONFIG task type {EVALUATOR!r} evaluates the checkpoints of a "
                           f"cluster's run, but --strategy {strategy} has no cluster; use "
                           f"--strategy {' or '.join(JOBS)}")
    return False


def require_cluster(strategy: str, environ: Mapping[str, str] | None = None,
                    source: str = "auto") -> ClusterConfig:
    """The checked ``TF_CONFIG`` of this process for a cluster strategy.

    ``source`` (``--cluster``): ``auto`` reads ``TF_CONFIG``, and without it a task of a
    Slurm job step (``srun``) gets the cluster of the step
    (:mod:`tfpar.parallel.cluster.slurm`); ``tf_config`` reads only ``TF_CONFIG``;
    ``slurm`` only the Slurm step (a ``TF_CONFIG`` in the environment is then replaced).
    A Slurm step's cluster is written to this process's ``TF_CONFIG``, where
    TensorFlow's strategies read it.

    Raises:
      ClusterError: ``TF_CONFIG`` is unset (outside Slurm) or wrong for ``strategy``;
        ``--cluster slurm`` outside a Slurm job step.
    """
    env = os.environ if environ is None else environ
    text = "" if source == "slurm" else env.get("TF_CONFIG", "").strip()
    if not text and source != "tf_config":
        from tfpar.parallel.cluster import slurm

        if source == "slurm" and not slurm.in_slurm_step(env):
            missing = [v for v in slurm.STEP_VARIABLES if v not in env]
            raise ClusterError(
                f"--cluster slurm: this process is not a task of a Slurm job step "
                f"({', '.join(missing)} unset); start it with srun inside an allocation, or "
                "use --cluster tf_config")
        if slurm.in_slurm_step(env):
            text = tf_config_json(*slurm.slurm_cluster(strategy, env))
            os.environ["TF_CONFIG"] = text
            config = parse_tf_config(text)
            logging.getLogger(__name__).info(
                "cluster from the Slurm job step: %s %d of %s", config.task_type,
                config.task_index, ", ".join(f"{len(a)} {job}" for job, a in
                                             config.cluster.items()))
    if not text:
        raise ClusterError(
            f"--strategy {strategy} needs a cluster, but TF_CONFIG is not set; start one on "
            f"this machine with {command('tfpar-launch', f'--workers 2 -- --strategy {strategy} ...')}"
            ", or set TF_CONFIG in every process of your cluster")
    config = parse_tf_config(text)
    check_jobs(config, strategy)
    return config


def check_port_free(address: str, *, what: str = "this task's address") -> None:
    """Fails early, with a clear message, when ``address``'s port is taken on this host.

    TensorFlow's gRPC server binds with SO_REUSEPORT, so a second server on a port in use
    may start silently and receive half of the traffic; a plain bind (SO_REUSEADDR only,
    so a port in TIME_WAIT still counts as free) finds every listener.

    Raises:
      ClusterError: something is listening on (or bound to) the port.
    """
    host, port = split_address(address)
    bind_host = LOOPBACK if host in (LOOPBACK, "localhost") else ""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise ClusterError(f"cannot bind port {port} of {what} {address}: "
                                   f"{e.strerror}") from None
            raise ClusterError(f"port {port} of {what} {address} is already in use; stop the "
                               "process holding it or give this task another port") from None


class PortReservation:
    """``count`` distinct loopback ports picked by the OS and held until :meth:`release`.

    Each port stays bound (SO_REUSEADDR and SO_REUSEPORT, never listening) for as long as
    the job that uses it runs, so no other program (nor a side-by-side job picking its own
    ports) is handed it meanwhile: a plain bind, a bind to port 0 and the source port of a
    ``connect`` all skip a bound port. Our tasks still get it: TensorFlow's gRPC server
    binds with SO_REUSEPORT, and :func:`check_port_free` (SO_REUSEADDR, which Linux lets
    share a port nobody listens on) still finds a real listener.

    Usable as a context manager.
    """

    def __init__(self, count: int, host: str = LOOPBACK):
        self._sockets: list[socket.socket] = []
        try:
            for _ in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._sockets.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                s.bind((host, 0))
        except BaseException:
            self.release()
            raise
        self.ports = [s.getsockname()[1] for s in self._sockets]

    def release(self) -> None:
        """Lets the ports go (idempotent)."""
        for s in self._sockets:
            s.close()
        self._sockets = []

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
