"""tfpar.parallel.cluster: TF_CONFIG parsing and checks, ports, job plans, and the local launcher's
process handling (with tiny Python child processes, so these run in seconds)."""

import io
import json
import os
import re
import socket
import sys
import time

import pytest

from tfpar.parallel.cluster.tf_config import (PortReservation, check_jobs, check_port_free,
                                              parse_tf_config, require_cluster, tf_config_json)
from tfpar.parallel.cluster.local_job import (PREEMPTED, LocalJob, flag_value, plan_job, run_job,
                                              train_args_for_cluster)
from tfpar.errors import ClusterError

MW = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}
PS = {"chief": ["127.0.0.1:2220"], "worker": ["127.0.0.1:2221", "127.0.0.1:2222"],
      "ps": ["127.0.0.1:2223"]}


def tf_config(cluster_dict, task_type="worker", index=0):
    return json.dumps({"cluster": cluster_dict, "task": {"type": task_type, "index": index}})


@pytest.fixture
def listening_port():
    """A loopback port something is listening on, for the duration of the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# ----------------------------------------------------------------------------- TF_CONFIG
def test_parse_reads_the_cluster_and_the_task():
    config = parse_tf_config(tf_config(MW, "worker", 1))
    assert config.cluster == {"worker": ("127.0.0.1:2222", "127.0.0.1:2223")}
    assert (config.task_type, config.task_index) == ("worker", 1)
    assert config.address == "127.0.0.1:2223"
    assert json.loads(config.to_json()) == json.loads(tf_config(MW, "worker", 1))


@pytest.mark.parametrize("text, message", [
    ("{not json", r"TF_CONFIG is not valid JSON \(.* at character 1\)"),
    ("[1, 2]", "TF_CONFIG must be a JSON object with cluster and task, got list"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), 'TF_CONFIG has no "cluster"'),
    (json.dumps({"cluster": MW}), 'TF_CONFIG has no "task" with a type and an index'),
    (json.dumps({"cluster": MW, "task": {"type": "worker"}}), 'no "task" with a type and an index'),
    (tf_config(MW, "chief", 0), r"task type 'chief' is not a job of the cluster \(worker\)"),
    (tf_config(MW, "worker", 2),
     r"task index 2 is out of range: job 'worker' has 2 task\(s\), so 0..1"),
    (tf_config(MW, "worker", -1), "task index -1 is out of range"),
    (tf_config(MW, "worker", "0"), "task index '0' is out of range"),
    (tf_config({"worker": []}), "job 'worker' must be a non-empty list of host:port addresses"),
    (tf_config({"worker": ["127.0.0.1"]}), "address '127.0.0.1' is not host:port"),
    (tf_config({"worker": ["h:99999"]}),
     "address 'h:99999' is not host:port with a port in 1..65535"),
])
def test_malformed_tf_config_is_one_line_error(text, message):
    with pytest.raises(ClusterError, match=message):
        parse_tf_config(text)


def test_a_cluster_strategy_without_tf_config_is_refused():
    with pytest.raises(ClusterError, match="--strategy multi_worker needs a cluster, but TF_CONFIG "
                                           "is not set; start one on this machine with "
                                           r"tfpar-launch --workers 2 -- --strategy "
                                           r"multi_worker \.\.\. \(from a clone: python "
                                           r"scripts/launch_local\.py --workers 2 -- "
                                           r"--strategy multi_worker \.\.\.\), or set"):
        require_cluster("multi_worker", environ={})


@pytest.mark.parametrize("strategy, jobs, message", [
    ("parameter_server", {"worker": MW["worker"], "ps": ["127.0.0.1:2224"]},
     r"--strategy parameter_server needs a 'chief' task \(the coordinator\), but TF_CONFIG's "
     "cluster has only: worker, ps"),
    ("parameter_server", {"chief": ["127.0.0.1:1"], "worker": MW["worker"]},
     r"needs one or more 'ps' tasks \(they hold the variables\)"),
    ("multi_worker", {"worker": MW["worker"], "ps": ["127.0.0.1:2224"]},
     "--strategy multi_worker has no 'ps' tasks, but TF_CONFIG's cluster lists some"),
    ("multi_worker", {"chief": ["127.0.0.1:1", "127.0.0.1:2"], "worker": MW["worker"]},
     "TF_CONFIG lists 2 chief tasks; a cluster has at most one chief"),
])
def test_jobs_a_strategy_needs(strategy, jobs, message):
    env = {"TF_CONFIG": tf_config(jobs, "worker", 0)}
    with pytest.raises(ClusterError, match=message):
        require_cluster(strategy, environ=env)


def test_the_chief_is_worker_0_unless_there_is_a_chief_task():
    assert parse_tf_config(tf_config(MW, "worker", 0)).is_chief
    assert not parse_tf_config(tf_config(MW, "worker", 1)).is_chief
    assert parse_tf_config(tf_config(PS, "chief", 0)).is_chief
    assert not parse_tf_config(tf_config(PS, "worker", 0)).is_chief


# ----------------------------------------------------------------------------- ports
def test_a_port_in_use_is_reported(listening_port):
    with pytest.raises(ClusterError, match=f"port {listening_port} of worker 1 127.0.0.1:"
                                           f"{listening_port} is already in use"):
        check_port_free(f"127.0.0.1:{listening_port}", what="worker 1")


def test_reserved_ports_are_distinct_and_pass_a_tasks_check():
    with PortReservation(5) as reserved:
        assert len(set(reserved.ports)) == 5
        for port in reserved.ports:
            check_port_free(f"127.0.0.1:{port}")


def plain_bind_refused(port: int) -> bool:
    """Whether another program's plain bind to ``port`` fails (the port is taken)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_a_job_holds_its_ports_until_it_ends_and_its_tasks_still_bind_them():
    """The picked ports stay taken for everyone else until the plan is released, while a
    task's own check passes and a server binding like TensorFlow's gRPC (SO_REUSEPORT)
    listens on them and is reached; afterwards the ports are free again."""
    plan = plan_job("multi_worker", workers=2)
    ports = [int(a.rsplit(":", 1)[1]) for a in plan.cluster["worker"]]
    assert plan.reservation is not None and plan.reservation.ports == ports
    assert all(plain_bind_refused(p) for p in ports)  # nothing else can take them
    for port in ports:
        check_port_free(f"127.0.0.1:{port}", what="worker 0")  # the task's own check
        with socket.socket() as server:  # as gRPC binds
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            with pytest.raises(ClusterError, match="already in use"):  # a real listener
                check_port_free(f"127.0.0.1:{port}")
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    plan.release()
    plan.release()  # idempotent
    assert not any(plain_bind_refused(p) for p in ports)


def test_run_job_releases_each_attempts_ports(monkeypatch):
    plans = []

    def make_plan():
        plans.append(plan_job("multi_worker", workers=1))
        return plans[-1]

    status = run_job(make_plan, lambda task: [sys.executable, "-c", "raise SystemExit(3)"],
                     restarts=1, out=io.StringIO())
    assert status == 3 and len(plans) == 2
    assert not any(plain_bind_refused(int(a.rsplit(":", 1)[1]))
                   for p in plans for a in p.cluster["worker"])


@pytest.mark.parametrize("strategy,kwargs,per_task,want", [
    ("multi_worker", dict(workers=2), 2, {"worker 0": "0,1", "worker 1": "2,3"}),
    ("parameter_server", dict(workers=2, ps=1), 1,
     {"chief 0": "0", "worker 0": "1", "worker 1": "2", "ps 0": ""}),  # ps tasks: none
    ("multi_worker", dict(workers=2), 0, {"worker 0": "*", "worker 1": "*"}),  # untouched
])
def test_gpus_per_task_gives_each_computing_task_its_own(strategy, kwargs, per_task, want,
                                                         monkeypatch):
    """Each child prints the CUDA_VISIBLE_DEVICES it got (tiny Python children; a job
    stops at its first finished server, so not every print is read: the launch lines
    name every task's GPUs)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "*")
    out = io.StringIO()
    code = "import os; print('gpus=' + os.environ['CUDA_VISIBLE_DEVICES'])"
    status = run_job(lambda: plan_job(strategy, **kwargs),
                     lambda task: [sys.executable, "-c", code], out=out,
                     gpus_per_task=per_task, task_restarts=0)
    lines = out.getvalue().splitlines()
    got = {line[1:].split("]")[0]: line.split("gpus=")[1] for line in lines if "gpus=" in line}
    assert all(want[task] == gpus for task, gpus in got.items()), lines
    if strategy == "multi_worker":  # every task finishes: every print is read
        assert got == want, lines
    if per_task:
        launched = {m.group(1): m.group(2) for m in
                    map(re.compile(r"\[launch\] started (\w+ \d) \(pid \d+\) at \S+, GPUs "
                                   r"(.*)$").match, lines) if m}
        assert launched == {task: gpus or "none" for task, gpus in want.items()}, lines
    assert status in (0, 1)  # (parameter-server servers exiting early end that job)


def test_a_reservation_is_a_context_manager():
    with PortReservation(2) as reserved:
        assert len(set(reserved.ports)) == 2 and all(map(plain_bind_refused, reserved.ports))
    assert not any(map(plain_bind_refused, reserved.ports))


# ----------------------------------------------------------------------------- plans
def test_multi_worker_plan_has_workers_only():
    with PortReservation(3) as reserved:
        plan = plan_job("multi_worker", workers=3, ports=reserved.ports)
    assert [t.name for t in plan.tasks] == ["worker 0", "worker 1", "worker 2"]
    assert all(t.finishes for t in plan.tasks)
    assert list(plan.cluster) == ["worker"]
    config = parse_tf_config(plan.tf_config(plan.tasks[2]))
    assert (config.task_type, config.task_index) == ("worker", 2)
    assert all(a.startswith("127.0.0.1:") for a in plan.cluster["worker"])


def test_parameter_server_plan_has_a_chief_workers_and_ps():
    plan = plan_job("parameter_server", workers=2, ps=2)
    assert [t.name for t in plan.tasks] == ["chief 0", "worker 0", "worker 1", "ps 0", "ps 1"]
    # Only the coordinator finishes; workers and ps tasks serve until stopped.
    assert [t.finishes for t in plan.tasks] == [True, False, False, False, False]
    assert {job: len(a) for job, a in plan.cluster.items()} == {"chief": 1, "worker": 2, "ps": 2}
    check_jobs(parse_tf_config(plan.tf_config(plan.tasks[3])), "parameter_server")


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="mirrored", workers=2), r"--strategy mirrored runs in one process: use "
                                           r"tfpar-train \(from a clone: python "
                                           r"scripts/train\.py\)$"),
    (dict(strategy="multi_worker", workers=0), "--workers must be >= 1, got 0"),
    (dict(strategy="multi_worker", workers=2, ps=1),
     "--ps 1: multi_worker has no parameter servers"),
    (dict(strategy="parameter_server", workers=2, ps=0), "needs --ps >= 1"),
    (dict(strategy="multi_worker", workers=2, ports=[1234]),
     r"--ports lists 1 port\(s\) but the job has 2 tasks \(worker 0, worker 1\)"),
    (dict(strategy="multi_worker", workers=2, ports=[1234, 1234]), "--ports lists a port twice"),
])
def test_bad_plans_are_refused(kwargs, message):
    strategy = kwargs.pop("strategy")
    with pytest.raises(ClusterError, match=message):
        plan_job(strategy, **kwargs)


def test_a_given_port_that_is_taken_is_refused(listening_port):
    with pytest.raises(ClusterError, match=f"port {listening_port} of worker 1 .* already in use"):
        with PortReservation(1) as reserved:
            plan_job("multi_worker", workers=2, ports=[reserved.ports[0], listening_port])


def test_train_args_get_one_shared_model_dir():
    strategy, args = train_args_for_cluster(["--strategy", "multi_worker", "--lr", "1"])
    assert strategy == "multi_worker"
    assert flag_value(args, "--model-dir").startswith(os.path.join("runs", "multi_worker-"))
    _, args = train_args_for_cluster(["--strategy=parameter_server", "--model-dir=m"])
    assert flag_value(args, "--model-dir") == "m" and "--model-dir" not in args
    with pytest.raises(ClusterError, match="give tfpar-train's --strategy after --"):
        train_args_for_cluster(["--lr", "1"])


# ----------------------------------------------------------------------------- processes
def python_tasks(scripts: dict):
    """A command factory: task name -> Python code run by that task."""
    return lambda task: [sys.executable, "-c", scripts[task.name]]


def test_job_streams_prefixed_output_and_succeeds():
    out = io.StringIO()
    plan = plan_job("multi_worker", workers=2)
    code = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
            "print('hello from', c['task']['index'])")
    status = run_job(lambda: plan, python_tasks({"worker 0": code, "worker 1": code}),
                     out=out)
    assert status == 0
    lines = out.getvalue().splitlines()
    assert "[worker 0] hello from 0" in lines and "[worker 1] hello from 1" in lines


def test_a_failed_task_stops_the_others(tmp_path):
    out = io.StringIO()
    pid_file = tmp_path / "pid"
    sleeper = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
               "time.sleep(600)")
    failing = (f"import os, time\nwhile not os.path.exists({str(pid_file)!r}): time.sleep(0.01)\n"
               "raise SystemExit(3)")
    plan = plan_job("multi_worker", workers=2)
    status = run_job(lambda: plan, python_tasks({"worker 0": sleeper, "worker 1": failing}),
                     out=out)
    assert status == 3
    assert "[launch] worker 1 exited with status 3; stopping the job" in out.getvalue()
    with pytest.raises(ProcessLookupError):  # stopped and reaped by the launcher
        os.kill(int(pid_file.read_text()), 0)


def test_restarts_run_the_whole_job_again(tmp_path):
    marker = tmp_path / "failed-once"
    flaky = (f"import os\nif not os.path.exists({str(marker)!r}):\n"
             f"    open({str(marker)!r}, 'w').close(); raise SystemExit(1)")
    scripts = {"worker 0": "print('ok')", "worker 1": flaky}
    out = io.StringIO()
    assert run_job(lambda: plan_job("multi_worker", workers=2),
                   python_tasks(scripts), restarts=1, out=out) == 0
    assert "[launch] restarting the whole job (restart 1 of 1)" in out.getvalue()
    marker.unlink()
    assert run_job(lambda: plan_job("multi_worker", workers=2),
                   python_tasks(scripts), restarts=0, out=io.StringIO()) == 1


def test_a_preempted_job_waits_for_every_worker_then_is_relaunched_or_ends_75(tmp_path):
    """Worker 1 exits 75 at once, worker 0 (still saving, say) a moment later: the launcher
    does not stop worker 0 but waits for its 75 too, then relaunches the job (a restart
    of --restarts), or, with none left, returns 75."""
    marker = tmp_path / "preempted-once"
    later = (f"import os, time\nif not os.path.exists({str(marker)!r}):\n"
             f"    time.sleep(1); open({str(marker)!r}, 'w').close(); raise SystemExit(75)")
    first = f"import os\nif not os.path.exists({str(marker)!r}): raise SystemExit(75)"
    scripts = {"worker 0": later, "worker 1": first}
    out = io.StringIO()
    assert run_job(lambda: plan_job("multi_worker", workers=2), python_tasks(scripts),
                   restarts=1, out=out) == 0
    lines = [line for line in out.getvalue().splitlines() if not line.startswith("[launch] started")]
    assert lines == [
        f"[launch] worker 1 stopped for a preemption (status {PREEMPTED}), its checkpoint "
        "saved; waiting for the other workers to stop after the same step",
        f"[launch] worker 0 stopped for the preemption too (status {PREEMPTED})",
        "[launch] restarting the whole job (restart 1 of 1): it resumes from the step every "
        "worker saved at the preemption"]
    marker.unlink()
    assert run_job(lambda: plan_job("multi_worker", workers=2), python_tasks(scripts),
                   restarts=0, out=io.StringIO()) == PREEMPTED


def test_a_signal_to_the_launcher_reaches_the_workers_once_and_ends_the_job(tmp_path):
    """SIGTERM to the launcher: each worker gets one SIGTERM (it saves and exits 75, as
    preempted), the job is not restarted although --restarts allows it, and the
    launcher returns 75. The tasks run in sessions of their own (a terminal's Ctrl-C
    reaches the launcher only). A second signal stops every task at once."""
    import signal
    import threading

    def worker(name):  # counts its SIGTERMs; exits 75 on the first, unless told to wait
        return (f"import os, signal, sys, time\n"
                f"got = []\n"
                f"def on_term(*a):\n"
                f"    got.append(1)\n"
                f"    open({str(tmp_path)!r} + '/{name}.term', 'a').write('x')\n"
                f"    if not os.path.exists({str(tmp_path)!r} + '/hold'): sys.exit(75)\n"
                f"    if len(got) > 1: sys.exit(130)\n"
                f"signal.signal(signal.SIGTERM, on_term)\n"
                f"assert os.getsid(0) == os.getpid()\n"  # a session of its own
                f"open({str(tmp_path)!r} + '/{name}.up', 'w').close()\n"
                f"deadline = time.time() + 20\n"  # no SIGTERM passed on: ends 0 (test fails)
                f"while time.time() < deadline: time.sleep(0.05)\n")

    def signal_launcher_when_up(times):
        def send():
            while not all((tmp_path / f"worker {i}.up").exists() for i in range(2)):
                time.sleep(0.02)
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)
        threading.Thread(target=send, daemon=True).start()

    scripts = {f"worker {i}": worker(f"worker {i}") for i in range(2)}
    out = io.StringIO()
    before = signal.getsignal(signal.SIGTERM)
    signal_launcher_when_up(1)
    status = run_job(lambda: plan_job("multi_worker", workers=2), python_tasks(scripts),
                     restarts=1, out=out)
    assert status == PREEMPTED, out.getvalue()
    log = out.getvalue()
    assert ("[launch] SIGTERM received: SIGTERM passed on to worker 0, worker 1; they stop "
            "after the same step and save it, and the job is not restarted (a second signal "
            "stops every task at once)") in log
    assert "restarting" not in log
    assert [(tmp_path / f"worker {i}.term").read_text() for i in range(2)] == ["x", "x"]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back

    (tmp_path / "hold").touch()  # the workers now wait after a first SIGTERM
    for i in range(2):
        (tmp_path / f"worker {i}.up").unlink()
    signal_launcher_when_up(2)
    with pytest.raises(KeyboardInterrupt):
        run_job(lambda: plan_job("multi_worker", workers=2), python_tasks(scripts),
                out=io.StringIO())
    # One SIGTERM passed on, then the stop's own: each worker saw two and ended.
    assert [(tmp_path / f"worker {i}.term").read_text() for i in range(2)] == ["xxx", "xxx"]


def test_a_worker_that_goes_on_after_a_preemption_fails_the_job(tmp_path):
    """Worker 1 exits 75; worker 0 neither stops within ``drain`` seconds (it is stopped)
    nor may it finish with 0 instead: either way the job failed (status 1)."""
    forever = "import time; time.sleep(600)"
    for worker0, drain, said in ((forever, 0.5, "[launch] worker 0 did not stop within 0.5 s "
                                  "of the preemption; stopping the job"),
                                 ("import time; time.sleep(1)", 60.0,
                                  "[launch] worker 0 exited with status 0 while the others "
                                  "stopped for a preemption; stopping the job")):
        out = io.StringIO()
        job = LocalJob(plan_job("multi_worker", workers=2),
                       python_tasks({"worker 0": worker0, "worker 1": "raise SystemExit(75)"}),
                       out=out, drain=drain)
        try:
            job.start()
            assert job.wait().status == 1
        finally:
            job.plan.release()
        assert said in out.getvalue().splitlines(), out.getvalue()


def test_a_usage_error_is_not_restarted():
    out = io.StringIO()
    scripts = {"worker 0": "raise SystemExit(2)", "worker 1": "raise SystemExit(2)"}
    assert run_job(lambda: plan_job("multi_worker", workers=2),
                   python_tasks(scripts), restarts=3, out=out) == 2
    assert "restarting" not in out.getvalue()


def test_a_server_that_exits_early_fails_the_job():
    out = io.StringIO()
    forever = "import time; time.sleep(600)"
    scripts = {"chief 0": forever, "worker 0": "pass", "ps 0": forever}
    plan = plan_job("parameter_server", workers=1, ps=1)
    assert run_job(lambda: plan, python_tasks(scripts), out=out) == 1
    assert "[launch] worker 0 exited before the job finished; stopping the job" in out.getvalue()


def test_servers_are_stopped_when_the_chief_finishes():
    out = io.StringIO()
    forever = "import time; time.sleep(600)"
    scripts = {"chief 0": "print('done')", "worker 0": forever, "ps 0": forever}
    plan = plan_job("parameter_server", workers=1, ps=1)
    assert run_job(lambda: plan, python_tasks(scripts), out=out) == 0
    assert "[chief 0] done" in out.getvalue()


def test_a_lost_parameter_server_worker_is_started_again_alone(tmp_path):
    marker, back = tmp_path / "failed-once", tmp_path / "back"
    worker = (f"import os, time\nif not os.path.exists({str(marker)!r}):\n"
              f"    open({str(marker)!r}, 'w').close(); raise SystemExit(1)\n"
              f"open({str(back)!r}, 'w').close(); time.sleep(600)")
    chief = (f"import os, time\nwhile not os.path.exists({str(back)!r}): time.sleep(0.01)\n"
             "print('done')")
    scripts = {"chief 0": chief, "worker 0": worker, "ps 0": "import time; time.sleep(600)"}
    plan = plan_job("parameter_server", workers=1, ps=1)
    out = io.StringIO()
    assert run_job(lambda: plan, python_tasks(scripts), out=out) == 0
    log = out.getvalue()
    assert ("[launch] worker 0 exited with status 1; starting it again alone (restart 1 of 3)"
            in log)
    assert log.count("[launch] started worker 0") == 2 and "[chief 0] done" in log
    assert "restarting the whole job" not in log

    marker.unlink()
    back.unlink()
    out = io.StringIO()  # without restarts for a single task, its loss ends the job
    assert run_job(lambda: plan, python_tasks(scripts), out=out, task_restarts=0) == 1
    assert "[launch] worker 0 exited with status 1; stopping the job" in out.getvalue()


# ----------------------------------------------------------------------------- Slurm
def slurm_env(procid, nodelist="node[1-2]", tasks_per_node="2(x2)", tasks=4, **extra):
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
            "CUDA_VISIBLE_DEVICES": "", **extra}


@pytest.mark.parametrize("procid,task", [(0, 0), (3, 3)])
def test_a_slurm_task_without_tf_config_gets_the_cluster_of_its_step(procid, task,
                                                                      monkeypatch):
    """srun's variables for 4 tasks on node1 and node2, 2 each (CPU nodes): one worker a
    task, a node's second task on the next port; written to TF_CONFIG for TensorFlow."""
    monkeypatch.setenv("TF_CONFIG", "")  # unset for tfpar; restored after the test
    env = slurm_env(procid)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = require_cluster("multi_worker")
    assert config.cluster == {"worker": ("node1:8888", "node1:8889", "node2:8888",
                                         "node2:8889")}
    assert (config.task_type, config.task_index) == ("worker", task)
    assert parse_tf_config(os.environ["TF_CONFIG"]) == config
    monkeypatch.setenv("TFPAR_SLURM_PORT_BASE", "7000")
    monkeypatch.setenv("TF_CONFIG", "")
    assert require_cluster("multi_worker").cluster["worker"][1] == "node1:7001"


@pytest.mark.parametrize("env,strategy,message", [
    (slurm_env(0), "parameter_server", "--strategy parameter_server under Slurm needs "
     "TF_CONFIG (chief, worker and ps roles); only multi_worker builds its cluster from srun"),
    (slurm_env(0, TFPAR_SLURM_PORT_BASE="x"), "multi_worker",
     "TFPAR_SLURM_PORT_BASE 'x' is not a port number"),
    (slurm_env(0, tasks=5), "multi_worker", "cannot lay out the Slurm job step as a cluster: "
     "Requested 5 tasks but only 4 were assigned."),
])
def test_slurm_steps_that_cannot_be_a_cluster_are_one_line(env, strategy, message,
                                                           monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "")  # unset for tfpar; restored after the test
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ClusterError) as e:
        require_cluster(strategy)
    assert str(e.value) == message
    assert os.environ["TF_CONFIG"] == ""


def test_cluster_slurm_reads_only_the_step_and_tf_config_only_the_variable(monkeypatch, tmp_path):
    """--cluster slurm takes the step's cluster even where a TF_CONFIG is set, without
    calling scontrol (a fake one on PATH records any call); --cluster tf_config inside a
    Slurm step still wants TF_CONFIG; --cluster slurm outside a step is one line."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(f"#!/bin/sh\necho called >> {tmp_path}/scontrol.log\n"
                                   "echo node9\n")
    (fake / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    other = tf_config_json({"worker": ["elsewhere:1", "elsewhere:2"]}, "worker", 1)
    monkeypatch.setenv("TF_CONFIG", other)
    for k, v in slurm_env(2).items():
        monkeypatch.setenv(k, v)
    config = require_cluster("multi_worker", source="slurm")
    assert config.cluster == {"worker": ("node1:8888", "node1:8889", "node2:8888",
                                         "node2:8889")}
    assert (config.task_type, config.task_index) == ("worker", 2)
    assert not (tmp_path / "scontrol.log").exists()
    monkeypatch.setenv("TF_CONFIG", other)
    assert require_cluster("multi_worker").cluster == {"worker": ("elsewhere:1", "elsewhere:2")}
    monkeypatch.setenv("TF_CONFIG", "")
    with pytest.raises(ClusterError, match="needs a cluster, but TF_CONFIG is not set"):
        require_cluster("multi_worker", source="tf_config")
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(ClusterError) as e:
        require_cluster("multi_worker", source="slurm")
    assert str(e.value) == (
        "--cluster slurm: this process is not a task of a Slurm job step (SLURM_PROCID, "
        "SLURM_STEP_NODELIST unset); start it with srun inside an allocation, or use "
        "--cluster tf_config")


def test_outside_slurm_a_missing_tf_config_is_still_an_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "")  # unset for tfpar; restored after the test
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(ClusterError, match="needs a cluster, but TF_CONFIG is not set"):
        require_cluster("multi_worker")
