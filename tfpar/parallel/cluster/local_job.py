"""A whole cluster on this machine: real processes talking gRPC over 127.0.0.1.

:func:`plan_job` lays out the tasks of a local ``multi_worker`` or ``parameter_server``
job on free loopback ports; :class:`LocalJob` runs them as child processes, each with its
own ``TF_CONFIG`` (see :mod:`tfpar.parallel.cluster.tf_config`), its output prefixed with
its task; :func:`run_job` restarts the whole job after a failure or a preemption. The
last functions turn training flags into the command every task runs (``python -m
tfpar.tools.train``: this package, not a file of a clone, so an installed tfpar starts
clusters too). Used by ``tfpar-launch`` (:mod:`tfpar.tools.launch`) and ``tfpar-verify``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import signal
import site
import subprocess
import sys
import threading
from typing import Callable, Mapping, Sequence, TextIO

from tfpar.errors import ClusterError, Preempted, command
from tfpar.parallel.cluster.tf_config import (CLUSTER_STRATEGIES, JOBS, LOOPBACK,
                                              PortReservation, check_port_free, tf_config_json)

# The module every task of a launched job runs (``python -m``).
TRAIN_MODULE = "tfpar.tools.train"
# The folder that holds this tfpar package: a clone's root, or site-packages.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def package_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a child Python that must import this same tfpar from any working
    directory: :data:`PACKAGE_ROOT` first on ``PYTHONPATH``, unless it is a site-packages
    folder (an installed tfpar), which every Python of this environment already reads and
    which must not come before the standard library."""
    env = dict(env)
    installed = {os.path.realpath(p) for p in [*site.getsitepackages(),
                                               site.getusersitepackages()]}
    if os.path.realpath(PACKAGE_ROOT) not in installed:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


@dataclasses.dataclass(frozen=True)
class Task:
    """One process of a local job."""

    type: str
    index: int
    # Whether the job is done only when this task has exited 0; False for servers
    # (parameter-server workers and ps tasks), which run until they are stopped.
    finishes: bool = True
    # Whether a failure of this task alone is repaired by starting it again, the job
    # going on: parameter-server workers hold no state (the ps tasks hold the variables,
    # the chief the loop), and TF's ClusterCoordinator re-schedules the steps a lost
    # worker was running and uses the worker again once it is back.
    restartable: bool = False

    @property
    def name(self) -> str:
        return f"{self.type} {self.index}"


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The tasks of a local cluster and the TF_CONFIG cluster they share."""

    tasks: tuple[Task, ...]
    cluster: dict[str, tuple[str, ...]]
    # The picked ports, held until the job ends (None: the ports were given).
    reservation: PortReservation | None = dataclasses.field(default=None, compare=False)

    def tf_config(self, task: Task) -> str:
        return tf_config_json(self.cluster, task.type, task.index)

    def gpus(self, task: Task, per_task: int) -> str:
        """``CUDA_VISIBLE_DEVICES`` of ``task`` when each computing task (chief, workers;
        not ps tasks, which only hold variables) gets ``per_task`` GPUs of its own, in
        task order: worker 1 of a multi_worker job with 2 each gets "2,3"."""
        computing = [t for t in self.tasks if t.type != "ps"]
        if task not in computing:
            return ""
        first = computing.index(task) * per_task
        return ",".join(str(first + i) for i in range(per_task))

    def release(self) -> None:
        """Lets the picked ports go once no task of this plan runs any more."""
        if self.reservation is not None:
            self.reservation.release()


def check_cluster_strategy(strategy: str) -> None:
    """Raises ClusterError unless ``strategy`` runs on a cluster."""
    if strategy not in JOBS:
        raise ClusterError(
            f"tfpar-launch starts clusters for --strategy {' or '.join(CLUSTER_STRATEGIES)}; "
            f"--strategy {strategy} runs in one process: use {command('tfpar-train')}")


def plan_job(strategy: str, *, workers: int, ps: int = 0,
             ports: Sequence[int] | None = None) -> JobPlan:
    """The tasks and loopback addresses of a local ``strategy`` cluster.

    ``multi_worker``: ``workers`` worker tasks, worker 0 the chief. ``parameter_server``:
    a chief (the coordinator), ``workers`` workers and ``ps`` ps tasks. ``ports`` are used
    in task order (chief, workers, ps) and checked; by default free ones are picked and
    held (:class:`PortReservation`) until :meth:`JobPlan.release`, so nothing else can
    take one between the pick and the task's bind.

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
                 + tuple(Task("worker", i, finishes=False, restartable=True)
                         for i in range(workers))
                 + tuple(Task("ps", i, finishes=False) for i in range(ps)))
    if ports:
        if len(ports) != len(tasks):
            raise ClusterError(f"--ports lists {len(ports)} port(s) but the job has {len(tasks)} "
                               f"tasks ({', '.join(t.name for t in tasks)}); give one per task")
        if len(set(ports)) != len(ports):
            raise ClusterError(f"--ports lists a port twice: {','.join(map(str, ports))}")
        for task, port in zip(tasks, ports):
            check_port_free(f"{LOOPBACK}:{port}", what=task.name)
        reservation = None
    else:
        reservation = PortReservation(len(tasks))
        ports = reservation.ports
    cluster: dict[str, list[str]] = {}
    for task, port in zip(tasks, ports):
        cluster.setdefault(task.type, []).append(f"{LOOPBACK}:{port}")
    return JobPlan(tasks, {job: tuple(a) for job, a in cluster.items()}, reservation)


# The status of a task that stopped for a stop signal together with every other worker
# of a multi_worker job, the job's checkpoint of that step saved (tfpar.errors.Preempted).
PREEMPTED = Preempted.exit_code


@dataclasses.dataclass
class Outcome:
    """How one attempt of a job ended."""

    # 0: every finishing task exited 0; PREEMPTED: every one exited PREEMPTED;
    # otherwise the first failed task's status.
    status: int

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
    ``grace`` seconds). A restartable task (a parameter-server worker) that fails is
    started again alone, on its address, up to ``task_restarts`` times per job; only
    then does its failure end the job. A task that exits PREEMPTED stopped together with
    the others, which are saving the same checkpoint: they get ``drain`` seconds to exit
    PREEMPTED too before they are stopped.
    """

    def __init__(self, plan: JobPlan, command: Callable[[Task], list[str]], *,
                 out: TextIO | None = None, env: Mapping[str, str] | None = None,
                 grace: float = 10.0, task_restarts: int = 3, gpus_per_task: int = 0,
                 drain: float = 60.0):
        self.plan, self.command, self.grace, self.drain = plan, command, grace, drain
        self.gpus_per_task = gpus_per_task
        self.task_restarts = task_restarts
        self.restarted: dict[Task, int] = {}
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
            self._spawn(task)

    def _spawn(self, task: Task) -> None:
        env = dict(package_env(self.env), TF_CONFIG=self.plan.tf_config(task),
                   PYTHONUNBUFFERED="1")
        gpus = ""
        if self.gpus_per_task:
            env["CUDA_VISIBLE_DEVICES"] = self.plan.gpus(task, self.gpus_per_task)
            gpus = f", GPUs {env['CUDA_VISIBLE_DEVICES'] or 'none'}"
        # Its own session: a Ctrl-C in the terminal reaches the launcher alone, which
        # passes one SIGTERM on (a task's second signal would stop it at once).
        proc = subprocess.Popen(self.command(task), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.processes[task] = proc
        self.emit(f"[launch] started {task.name} (pid {proc.pid}) at "
                  f"{self.plan.cluster[task.type][task.index]}{gpus}")
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
        preempted = False
        try:
            while pending:
                try:
                    task, status = self._events.get(timeout=self.drain if preempted else None)
                except queue.Empty:
                    self.emit(f"[launch] {', '.join(sorted(t.name for t in pending))} did not "
                              f"stop within {self.drain:g} s of the preemption; stopping the job")
                    return Outcome(1)
                if status == PREEMPTED and task.finishes:
                    if not preempted:
                        others = ("; waiting for the other workers to stop after the same "
                                  "step" if len(pending) > 1 else "")
                        self.emit(f"[launch] {task.name} stopped for a preemption (status "
                                  f"{PREEMPTED}), its checkpoint saved{others}")
                    else:
                        self.emit(f"[launch] {task.name} stopped for the preemption too "
                                  f"(status {PREEMPTED})")
                    preempted = True
                    pending.discard(task)
                    continue
                if preempted and status == 0:  # the workers did not stop together
                    self.emit(f"[launch] {task.name} exited with status 0 while the others "
                              "stopped for a preemption; stopping the job")
                    return Outcome(1)
                if status != 0 or not task.finishes:
                    what = describe_status(status) if status else "exited before the job finished"
                    done = self.restarted.get(task, 0)
                    if task.restartable and done < self.task_restarts and status != 2:
                        self.restarted[task] = done + 1
                        self.emit(f"[launch] {task.name} {what}; starting it again alone "
                                  f"(restart {done + 1} of {self.task_restarts}); the "
                                  "coordinator re-schedules its steps")
                        self._spawn(task)
                        continue
                    self.emit(f"[launch] {task.name} {what}; stopping the job")
                    return Outcome(status if status else 1)
                pending.discard(task)
            return Outcome(PREEMPTED if preempted else 0)
        finally:
            self.stop()

    def signal_finishing(self, signum: int) -> list[str]:
        """Sends ``signum`` to every running task that finishes (not to servers, which
        :meth:`stop` ends once those have exited); returns their names."""
        sent = []
        for task, proc in self.processes.items():
            if task.finishes and proc.poll() is None:
                proc.send_signal(signum)
                sent.append(task.name)
        return sent

    def stop(self) -> None:
        """Stops every task still running: SIGTERM, then SIGKILL after ``grace`` seconds;
        says how each one ended (a parameter-server task ends with status 0 on SIGTERM)."""
        running = {t: p for t, p in self.processes.items() if p.poll() is None}
        for proc in running.values():
            proc.terminate()
        for task, proc in running.items():
            try:
                proc.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for thread in self._threads:
            thread.join(timeout=self.grace)
        for task, proc in running.items():
            self.emit(f"[launch] stopped {task.name}: it {describe_status(proc.returncode)}")


def run_job(make_plan: Callable[[], JobPlan], command: Callable[[Task], list[str]], *,
            restarts: int = 0, out: TextIO | None = None,
            env: Mapping[str, str] | None = None, task_restarts: int = 3,
            gpus_per_task: int = 0) -> int:
    """Runs a local job, restarting all of it up to ``restarts`` times after a failure.

    A restartable task (a parameter-server worker) is first started again alone, up to
    ``task_restarts`` times per attempt (see :class:`LocalJob`).

    A job whose workers all stopped for a preemption (status PREEMPTED, the checkpoint of
    one step saved) is restarted the same way, resuming from that step, and counts as
    one of the ``restarts``.

    ``gpus_per_task`` > 0 gives each computing task that many GPUs of its own
    (``CUDA_VISIBLE_DEVICES``, :meth:`JobPlan.gpus`).

    ``make_plan`` is called for every attempt, so a restart gets fresh free ports (the
    old ones may still be closing); each attempt's plan is released when it ends. A task that exits with status 2 (a usage error) ends
    the job at once: a restart would fail the same way.

    SIGTERM or SIGINT to this process (in the main thread) is passed on as one SIGTERM
    to the tasks that finish, which stop as for a preemption; the job is then not
    restarted. A second signal stops every task at once (KeyboardInterrupt).

    Returns:
      0 on success, PREEMPTED when the last attempt was preempted, else the failed task's
      status (1 for a signal or an early server exit).
    """
    with LauncherSignal() as stopping:
        return _run_attempts(make_plan, command, stopping, restarts=restarts, out=out,
                             env=env, task_restarts=task_restarts, gpus_per_task=gpus_per_task)


class LauncherSignal:
    """SIGTERM/SIGINT to the launcher, passed on to the current job's finishing tasks."""

    def __init__(self):
        self.received: str | None = None
        self.job: LocalJob | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        if self.job is not None:
            sent = self.job.signal_finishing(signal.SIGTERM)
            self.job.emit(f"[launch] {self.received} received: SIGTERM passed on to "
                          f"{', '.join(sent) or 'no running task'}; they stop after the same "
                          "step and save it, and the job is not restarted (a second signal "
                          "stops every task at once)")

    def __enter__(self) -> "LauncherSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _run_attempts(make_plan, command, stopping: LauncherSignal, *, restarts: int,
                  out, env, task_restarts: int, gpus_per_task: int) -> int:
    for attempt in range(restarts + 1):
        job = LocalJob(make_plan(), command, out=out, env=env, task_restarts=task_restarts,
                       gpus_per_task=gpus_per_task)
        stopping.job = job
        if attempt:
            job.emit(f"[launch] restarting the whole job (restart {attempt} of {restarts})"
                     + (": it resumes from the step every worker saved at the preemption"
                        if outcome.status == PREEMPTED else ""))
        try:
            job.start()
            outcome = job.wait()
        except BaseException:
            job.stop()
            raise
        finally:
            job.plan.release()
        if outcome.status == 0:
            return 0
        if not outcome.retryable or stopping.received:
            break
    return outcome.status if outcome.status > 0 else 1


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
    """The strategy named in training flags, and the flags with a shared ``--model-dir``.

    Every task (and every restart) must use the same model dir: the chief writes it,
    restarts resume from it. Without ``--model-dir`` each process would pick its own
    timestamped default, so one is chosen here, once.

    Raises:
      ClusterError: no --strategy, or one that does not run on a cluster.
    """
    strategy = flag_value(args, "--strategy")
    if strategy is None:
        raise ClusterError("give tfpar-train's --strategy after --, e.g. -- --strategy "
                           "multi_worker")
    check_cluster_strategy(strategy)
    args = list(args)
    if flag_value(args, "--model-dir") is None:
        model_dir = os.path.join("runs", f"{strategy}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        args += ["--model-dir", model_dir]
    return strategy, args


def train_command(args: Sequence[str]) -> Callable[[Task], list[str]]:
    """Every task runs ``python -m tfpar.tools.train <args>`` (what ``tfpar-train <args>``
    runs); its role comes from TF_CONFIG."""
    return lambda task: [sys.executable, "-m", TRAIN_MODULE, *args]
