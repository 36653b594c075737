"""Clusters of processes: ``TF_CONFIG``, loopback ports, the chief, and a local launcher.

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

:func:`require_cluster` reads and checks ``TF_CONFIG`` for a strategy; every problem is
a one-line :class:`~tfpar.errors.ClusterError`. The second half of the module starts a
whole cluster on this machine (:func:`run_job`, used by ``scripts/launch_local.py`` and
``scripts/verify_parallel.py``): real processes talking gRPC over 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable, Mapping, Sequence, TextIO

from tfpar.errors import ClusterError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Jobs each cluster strategy needs and accepts, in the order tasks are listed.
JOBS = {
    "multi_worker": {"required": ("worker",), "allowed": ("chief", "worker")},
    "parameter_server": {"required": ("chief", "worker", "ps"),
                         "allowed": ("chief", "worker", "ps")},
}
CLUSTER_STRATEGIES = tuple(JOBS)


# ----------------------------------------------------------------------------- TF_CONFIG
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
    if config.count("chief") > 1:
        raise ClusterError(f"TF_CONFIG lists {config.count('chief')} chief tasks; a cluster has "
                           "at most one chief")


def require_cluster(strategy: str, environ: Mapping[str, str] | None = None) -> ClusterConfig:
    """The checked ``TF_CONFIG`` of this process for a cluster strategy.

    Raises:
      ClusterError: ``TF_CONFIG`` is unset or wrong for ``strategy``.
    """
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
    if not text:
        raise ClusterError(
            f"--strategy {strategy} needs a cluster, but TF_CONFIG is not set; start one on "
            f"this machine with scripts/launch_local.py --workers 2 -- --strategy {strategy} "
            "..., or set TF_CONFIG in every process of your cluster")
    config = parse_tf_config(text)
    check_jobs(config, strategy)
    return config


# ----------------------------------------------------------------------------- ports
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


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports that are free on ``host`` right now.

    The OS picks them (bind to port 0); all sockets stay open until every port is chosen
    so none is picked twice. Another program could take one before our tasks bind it: a
    window of milliseconds that a task's own :func:`check_port_free` reports clearly.
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# ----------------------------------------------------------------------------- local jobs
@dataclasses.dataclass(frozen=True)
class Task:
    """One process of a local job."""

    type: str
    index: int
    # Whether the job is done only when this task has exited 0; False for servers
    # (parameter-server workers and ps tasks), which run until they are stopped.
    finishes: bool = True

    @property
    def name(self) -> str:
        return f"{self.type} {self.index}"


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The tasks of a local cluster and the TF_CONFIG cluster they share."""

    tasks: tuple[Task, ...]
    cluster: dict[str, tuple[str, ...]]

    def tf_config(self, task: Task) -> str:
        return tf_config_json(self.cluster, task.type, task.index)


def check_cluster_strategy(strategy: str) -> None:
    """Raises ClusterError unless ``strategy`` runs on a cluster."""
    if strategy not in JOBS:
        raise ClusterError(
            f"launch_local.py starts clusters for --strategy {' or '.join(CLUSTER_STRATEGIES)}; "
            f"--strategy {strategy} runs in one process: use scripts/train.py")


def plan_job(strategy: str, *, workers: int, ps: int = 0,
             ports: Sequence[int] | None = None) -> JobPlan:
    """The tasks and loopback addresses of a local ``strategy`` cluster.

    ``multi_worker``: ``workers`` worker tasks, worker 0 the chief. ``parameter_server``:
    a chief (the coordinator), ``workers`` workers and ``ps`` ps tasks. ``ports`` are used
    in task order (chief, workers, ps) and checked; by default free ones are picked.

    Raises:
      ClusterError: a strategy without a cluster, bad counts, or ports that are taken or
        are not one per task.
    """
    check_cluster_strategy(strategy)
    if workers < 1:
        raise ClusterError(f"--workers must be >= 1, got {workers}")
    if strategy == "multi_worker":
        if ps:
            raise ClusterError(f"--ps {ps}: multi_worker has no parameter servers (the workers "
                               "all-reduce their gradients); drop --ps or use "
                               "--strategy parameter_server")
        tasks = tuple(Task("worker", i) for i in range(workers))
    else:
        if ps < 1:
            raise ClusterError(f"--strategy parameter_server needs --ps >= 1 (tasks that hold "
                               f"the variables), got {ps}")
        tasks = ((Task("chief", 0),)
                 + tuple(Task("worker", i, finishes=False) for i in range(workers))
                 + tuple(Task("ps", i, finishes=False) for i in range(ps)))
    if ports:
        if len(ports) != len(tasks):
            raise ClusterError(f"--ports lists {len(ports)} port(s) but the job has {len(tasks)} "
                               f"tasks ({', '.join(t.name for t in tasks)}); give one per task")
        if len(set(ports)) != len(ports):
            raise ClusterError(f"--ports lists a port twice: {','.join(map(str, ports))}")
        for task, port in zip(tasks, ports):
            check_port_free(f"{LOOPBACK}:{port}", what=task.name)
    else:
        ports = free_ports(len(tasks))
    cluster: dict[str, list[str]] = {}
    for task, port in zip(tasks, ports):
        cluster.setdefault(task.type, []).append(f"{LOOPBACK}:{port}")
    return JobPlan(tasks, {job: tuple(a) for job, a in cluster.items()})


@dataclasses.dataclass
class Outcome:
    """How one attempt of a job ended."""

    # 0: every finishing task exited 0; otherwise the first failed task's status.
    status: int
    # The task that failed first (None on success).
    failed: Task | None = None

    @property
    def retryable(self) -> bool:
        """Status 2 is a usage error (bad flags, TF_CONFIG): a restart would fail the same."""
        return self.status not in (0, 2)


def describe_status(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


class LocalJob:
    """Runs every task of a :class:`JobPlan` as a child process, once.

    Each child gets its ``TF_CONFIG``; its output (stdout and stderr together) is streamed
    line by line to ``out`` with a ``[worker 1] `` prefix. The job ends when every
    finishing task has exited 0 (servers are then stopped) or when any task fails (or a
    server exits early): then every other task is stopped (SIGTERM, then SIGKILL after
    ``grace`` seconds).
    """

    def __init__(self, plan: JobPlan, command: Callable[[Task], list[str]], *,
                 out: TextIO | None = None, env: Mapping[str, str] | None = None,
                 grace: float = 10.0):
        self.plan, self.command, self.grace = plan, command, grace
        self.out = out if out is not None else sys.stdout
        self.env = dict(os.environ if env is None else env)
        self.processes: dict[Task, subprocess.Popen] = {}
        self._events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def emit(self, line: str) -> None:
        with self._lock:
            self.out.write(line if line.endswith("\n") else line + "\n")
            self.out.flush()

    def start(self) -> None:
        for task in self.plan.tasks:
            env = dict(self.env, TF_CONFIG=self.plan.tf_config(task), PYTHONUNBUFFERED="1")
            proc = subprocess.Popen(self.command(task), env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.processes[task] = proc
            self.emit(f"[launch] started {task.name} (pid {proc.pid}) at "
                      f"{self.plan.cluster[task.type][task.index]}")
            thread = threading.Thread(target=self._pump, args=(task, proc), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, task: Task, proc: subprocess.Popen) -> None:
        """Streams one child's output, then reports its exit status."""
        prefix = f"[{task.name}] "
        for raw in iter(proc.stdout.readline, b""):
            self.emit(prefix + raw.decode("utf-8", "replace").rstrip("\r\n"))
        self._events.put((task, proc.wait()))

    def wait(self) -> Outcome:
        """Blocks until the job succeeds or a task fails; every task is stopped on return."""
        pending = {t for t in self.plan.tasks if t.finishes}
        try:
            while pending:
                task, status = self._events.get()
                if status != 0 or not task.finishes:
                    what = describe_status(status) if status else "exited before the job finished"
                    self.emit(f"[launch] {task.name} {what}; stopping the job")
                    return Outcome(status if status else 1, task)
                pending.discard(task)
            return Outcome(0)
        finally:
            self.stop()

    def stop(self) -> None:
        """Stops every task still running: SIGTERM, then SIGKILL after ``grace`` seconds."""
        running = [p for p in self.processes.values() if p.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for thread in self._threads:
            thread.join(timeout=self.grace)


def run_job(make_plan: Callable[[], JobPlan], command: Callable[[Task], list[str]], *,
            restarts: int = 0, out: TextIO | None = None,
            env: Mapping[str, str] | None = None) -> int:
    """Runs a local job, restarting all of it up to ``restarts`` times after a failure.

    ``make_plan`` is called for every attempt, so a restart gets fresh free ports (the
    old ones may still be closing). A task that exits with status 2 (a usage error) ends
    the job at once: a restart would fail the same way.

    Returns:
      0 on success, else the failed task's status (1 for a signal or an early server exit).
    """
    for attempt in range(restarts + 1):
        job = LocalJob(make_plan(), command, out=out, env=env)
        if attempt:
            job.emit(f"[launch] restarting the whole job (restart {attempt} of {restarts})")
        try:
            job.start()
            outcome = job.wait()
        except BaseException:
            job.stop()
            raise
        if outcome.status == 0:
            return 0
        if not outcome.retryable:
            break
    return outcome.status if outcome.status > 0 else 1


# ----------------------------------------------------------------------------- train.py jobs
def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in ``args`` (the last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def train_args_for_cluster(args: Sequence[str]) -> tuple[str, list[str]]:
    """The strategy named in train.py flags, and the flags with a shared ``--model-dir``.

    Every task (and every restart) must use the same model dir: the chief writes it,
    restarts resume from it. Without ``--model-dir`` each process would pick its own
    timestamped default, so one is chosen here, once.

    Raises:
      ClusterError: no --strategy, or one that does not run on a cluster.
    """
    strategy = flag_value(args, "--strategy")
    if strategy is None:
        raise ClusterError("give train.py's --strategy after --, e.g. -- --strategy multi_worker")
    check_cluster_strategy(strategy)
    args = list(args)
    if flag_value(args, "--model-dir") is None:
        model_dir = os.path.join("runs", f"{strategy}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        args += ["--model-dir", model_dir]
    return strategy, args


def train_command(train_script: str, args: Sequence[str]) -> Callable[[Task], list[str]]:
    """Every task runs ``python train.py <args>``; its role comes from TF_CONFIG."""
    return lambda task: [sys.executable, train_script, *args]
