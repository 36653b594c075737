"""scripts/launch_local.py: usage errors, and real clusters that survive SIGKILLed tasks:
a multi_worker worker (job restart, resume from the last checkpoint, same steps), a
parameter_server worker (started again alone, its steps re-scheduled), ps task and chief
(job restart and resume); and a multi_worker job whose workers all stop after one step
when any of them gets SIGTERM (a preemption), then resume from that step."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import PINNED, REPO, write_sharded_corpus
from faults import checkpoint_tensors, compare_tensors

LAUNCH = os.path.join(REPO, "scripts", "launch_local.py")


def load_launcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_local", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2", "--", "--strategy", "mirrored"],
     "error: tfpar-launch starts clusters for --strategy multi_worker or parameter_server; "
     "--strategy mirrored runs in one process: use tfpar-train (from a clone: python "
     "scripts/train.py)"),
    (["--workers", "2", "--", "--lr", "1"], "error: give tfpar-train's --strategy after --"),
    (["--workers", "2", "--ps", "1", "--", "--strategy", "multi_worker"],
     "error: --ps 1: multi_worker has no parameter servers"),
    (["--workers", "2", "--ports", "7,x", "--", "--strategy", "multi_worker"],
     "error: --ports '7,x' must be comma-separated integers, one per task"),
    (["--workers", "1", "--restarts", "-1", "--", "--strategy", "multi_worker"],
     "error: --restarts must be >= 0, got -1"),
    (["--workers", "1", "--worker-restarts", "-2", "--", "--strategy", "parameter_server"],
     "error: --worker-restarts must be >= 0, got -2"),
    (["--workers", "1", "--gpus-per-task", "-1", "--", "--strategy", "multi_worker"],
     "error: --gpus-per-task must be >= 0, got -1"),
])
def test_usage_errors_start_nothing(argv, message, capsys):
    assert load_launcher().main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().startswith(message)
    assert len(captured.err.strip().splitlines()) == 1
    assert "[launch] started" not in captured.out


def test_a_given_port_that_is_taken_is_refused(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = load_launcher().main(["--workers", "2", "--ports", f"{port},{port + 1}", "--",
                                     "--strategy", "multi_worker"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: port {port} of worker 0 127.0.0.1:{port} is already in use; stop the process "
        "holding it or give this task another port")


def test_a_preempted_job_with_no_restart_left_says_to_run_again(tmp_path, monkeypatch,
                                                                capsys):
    """Every worker exited 75 (stopped after one step, checkpoint saved) and --restarts is
    used up: the launcher exits 75 with one line saying where the checkpoint is and to run
    the same command again. (The job itself: run_job's test in test_cluster.)"""
    from tfpar.parallel.cluster import local_job

    monkeypatch.setattr(local_job, "run_job", lambda *args, **kwargs: local_job.PREEMPTED)
    model_dir = tmp_path / "run"
    assert load_launcher().main(["--workers", "2", "--", "--strategy", "multi_worker",
                                 "--model-dir", str(model_dir)]) == 75
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: the multi_worker job was preempted (status 75): every worker stopped after "
        f"the same step and its checkpoint is saved in {model_dir}; run the same command again "
        "to resume (--restarts K relaunches it by itself)"]


def test_train_flags_are_required(capsys):
    with pytest.raises(SystemExit) as e:
        load_launcher().main(["--workers", "2"])
    assert e.value.code == 2
    assert "give tfpar-train's flags after --" in capsys.readouterr().err


def wait_for(condition, what: str, timeout: float):
    """Polls ``condition`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Launched:
    """A launch_local.py job running in the background, its output collected."""

    def __init__(self, tmp_path, launcher_args, train_args):
        self.proc = subprocess.Popen([sys.executable, LAUNCH, *launcher_args, "--", *train_args],
                                     cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                       daemon=True)
        self.reader.start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def pid(self, task: str) -> int:
        """The pid of ``task`` (e.g. "worker 1") as last started."""
        pattern = re.compile(rf"\[launch\] started {task} \(pid (\d+)\)")
        return int(wait_for(lambda: ([m.group(1) for m in map(pattern.match, list(self.lines))
                                      if m] or [None])[-1], f"{task} to start", 120))

    def kill(self, task: str) -> None:
        os.kill(self.pid(task), signal.SIGKILL)

    def finish(self, timeout=600) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(timeout=10)
        return self.proc.returncode


def small_run(tmp_path, strategy, max_steps, every, *extra, data=None):
    corpus = ["--data", str(data)] if data else ["--synthetic-sentences", "1000,50,50"]
    return ["--strategy", strategy, "--max-steps", str(max_steps),
            "--checkpoint-every", str(every), *corpus,
            *PINNED, "--embed-dim", "16", "--hidden-dim", "16", "--batch-size", "16",
            "--eval-batch-size", "100", "--no-progress", "--no-export",
            "--model-dir", str(tmp_path / "run"), "--metrics-json", str(tmp_path / "m.json"),
            *extra]


def latest_step(tmp_path) -> int:
    """The step of the checkpoint the manager's state file names (0: none yet). A
    checkpoint's files exist a moment before the state file names it, and a restart
    resumes from the named one, so tests wait on this, not on the files."""
    state = tmp_path / "run" / "checkpoints" / "checkpoint"
    try:
        text = state.read_text()
    except OSError:
        return 0
    found = re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', text, re.M)
    return int(found.group(1)) if found else 0


def checkpoint(tmp_path, step):
    return lambda: latest_step(tmp_path) >= step


def resumed_steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"\[(?:worker|chief) 0\] .*resumed from .* \(step (\d+)\)",
                                       log)]


def iterations(tmp_path) -> int:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "checkpoints"))
    return int(reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"))


# The 2-worker job the multi_worker fault tests run (60 steps from a folder of 4 train
# shards, 2 for each worker), and its run uninterrupted, which they must end equal to.
MW_STEPS = 60


@pytest.fixture(scope="module")
def uninterrupted_multi_worker(tmp_path_factory):
    """The folder of an uninterrupted 2-worker run of MW_STEPS steps: its ``corpus``
    (the shards every such test trains on), ``run`` (model dir) and ``m.json``."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    shards = write_sharded_corpus(folder / "corpus")
    ref = Launched(folder, ["--workers", "2"],
                   small_run(folder, "multi_worker", MW_STEPS, 5, data=shards))
    assert ref.finish() == 0, ref.log[-4000:]
    return folder


def assert_ends_as_uninterrupted(tmp_path, ref_dir) -> None:
    """Every checkpointed tensor (weights, Adam's slots, step and input counters) and
    the final metrics of the run in ``tmp_path`` equal the uninterrupted run's, bit for
    bit. (That multi_worker learns what one device learns is test_multi_worker's verify
    check.)"""
    comparison = compare_tensors(checkpoint_tensors(str(tmp_path / "run")),
                                 checkpoint_tensors(str(ref_dir / "run")))
    assert comparison.exact, comparison.describe()
    m = json.loads((tmp_path / "m.json").read_text())
    want = json.loads((ref_dir / "m.json").read_text())
    assert {k: m[k] for k in ("steps", "valid_ppl", "test_ppl")} == \
        {k: want[k] for k in ("steps", "valid_ppl", "test_ppl")}


@pytest.mark.cluster
def test_a_killed_worker_is_restarted_and_the_run_completes(tmp_path,
                                                            uninterrupted_multi_worker):
    """Trained from a folder of 4 train shards, 2 for each worker. The kill comes once
    the first checkpoint (step 5) exists, 55 steps before the end: a second or more of
    2-worker steps, against 50 ms between two polls of the state file."""
    max_steps, every = MW_STEPS, 5
    shards = uninterrupted_multi_worker / "corpus"
    job = Launched(tmp_path, ["--workers", "2", "--restarts", "1"],
                   small_run(tmp_path, "multi_worker", max_steps, every, data=shards))
    wait_for(checkpoint(tmp_path, every), "the first checkpoint", 300)
    job.kill("worker 1")  # mid-epoch: 1000 sentences are ~63 steps of 16
    assert job.finish() == 0, job.log[-4000:]
    log = job.log
    assert "[launch] worker 1 was killed by SIGKILL; stopping the job" in log
    assert "[launch] restarting the whole job (restart 1 of 1)" in log
    for worker in (0, 1):
        assert re.search(rf"\[worker {worker}\] .*input: each of the 2 workers reads its own 2 "
                         "of the 4 train files", log)
    resumed = resumed_steps(log)
    assert resumed and 0 < resumed[0] < max_steps and resumed[0] % every == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["strategy"], m["workers"], m["replicas"], m["steps"]) == \
        ("multi_worker", 2, 2, max_steps)
    assert_ends_as_uninterrupted(tmp_path, uninterrupted_multi_worker)


@pytest.mark.cluster
def test_sigterm_to_one_worker_stops_every_worker_after_the_same_step(
        tmp_path, uninterrupted_multi_worker):
    """SIGTERM to worker 1 once the periodic checkpoint of step 10 exists: both workers
    stop after one agreed step N > 10, both exit 75, the launcher relaunches the job
    (--restarts 1), both workers resume from the checkpoint of N, and the run ends equal
    to the uninterrupted one. (The launcher's side with fake tasks, and its message when
    no restart is left: test_cluster.)"""
    every = 10  # a preemption step on a multiple of 10 finds it saved already
    job = Launched(tmp_path, ["--workers", "2", "--restarts", "1"],
                   small_run(tmp_path, "multi_worker", MW_STEPS, every,
                             data=uninterrupted_multi_worker / "corpus"))
    wait_for(checkpoint(tmp_path, every), "the checkpoint of step 10", 300)
    os.kill(job.pid("worker 1"), signal.SIGTERM)
    assert job.finish() == 0, job.log[-4000:]
    log = job.log
    stopped = re.findall(r"\[(worker \d)\] error: preempted: (.*?); every worker stopped "
                         r"after step (\d+) and the checkpoint", log)
    assert sorted(w for w, _, _ in stopped) == ["worker 0", "worker 1"], log[-4000:]
    assert dict((w, who) for w, who, _ in stopped) == {
        "worker 0": "a stop signal reached another worker",
        "worker 1": "SIGTERM reached this worker"}
    steps = {int(n) for _, _, n in stopped}
    assert len(steps) == 1, stopped  # the same step on both workers
    step = steps.pop()
    assert every < step < MW_STEPS
    assert re.search(r"\[launch\] worker \d stopped for a preemption \(status 75\)", log)
    assert re.search(r"\[launch\] worker \d stopped for the preemption too \(status 75\)", log)
    assert ("[launch] restarting the whole job (restart 1 of 1): it resumes from the step "
            "every worker saved at the preemption") in log
    assert "Traceback" not in log, log[-4000:]
    # Both workers of the relaunch restore the checkpoint of that step.
    assert sorted(re.findall(r"\[(worker \d)\] .*resumed from .*ckpt-(\d+) \(step \d+\)",
                             log)) == [("worker 0", str(step)), ("worker 1", str(step))]
    assert_ends_as_uninterrupted(tmp_path, uninterrupted_multi_worker)


@pytest.mark.cluster
def test_sigterm_to_the_chief_of_three_workers_stops_all_three_after_the_same_step(
        tmp_path_factory):
    """Three workers on 6 train shards, SIGTERM to worker 0 (the chief) after ckpt-10:
    all three stop after one agreed step, exit 75 and resume there, and the run ends at
    its last step. (That a resumed multi-worker run ends equal, every tensor, to an
    uninterrupted one: test_sigterm_to_one_worker_stops_every_worker_after_the_same_step,
    on the same code path with two workers.)"""
    tmp_path = tmp_path_factory.mktemp("three_preempted")
    shards = write_sharded_corpus(tmp_path / "corpus", train_shards=6)
    every = 10
    job = Launched(tmp_path, ["--workers", "3", "--restarts", "1"],
                   small_run(tmp_path, "multi_worker", MW_STEPS, every, data=shards))
    wait_for(checkpoint(tmp_path, every), "the checkpoint of step 10", 300)
    os.kill(job.pid("worker 0"), signal.SIGTERM)
    assert job.finish() == 0, job.log[-4000:]
    log = job.log
    stopped = re.findall(r"\[(worker \d)\] error: preempted: (.*?); every worker stopped "
                         r"after step (\d+) and the checkpoint", log)
    assert dict((w, who) for w, who, _ in stopped) == {
        "worker 0": "SIGTERM reached this worker",
        "worker 1": "a stop signal reached another worker",
        "worker 2": "a stop signal reached another worker"}, log[-4000:]
    steps = {int(n) for _, _, n in stopped}
    assert len(steps) == 1 and every < min(steps) < MW_STEPS, stopped
    step = steps.pop()
    assert "Traceback" not in log, log[-4000:]
    assert sorted(re.findall(r"\[(worker \d)\] .*resumed from .*ckpt-(\d+) \(step \d+\)",
                             log)) == [(f"worker {i}", str(step)) for i in range(3)]
    assert json.loads((tmp_path / "m.json").read_text())["steps"] == MW_STEPS
    assert iterations(tmp_path) == MW_STEPS


@pytest.mark.cluster
def test_parameter_server_survives_a_lost_worker_then_a_lost_ps(tmp_path):
    """A worker SIGKILLed mid-run is started again alone and the coordinator re-schedules
    its steps (no job restart); later the ps task is SIGKILLed: the whole job restarts
    and resumes from the last checkpoint. Both end with the requested steps."""
    # Long enough for the lost worker to be back well before the end: in a trial on a
    # busy 2-core host it was back 5 s after its kill (at ckpt-50) and the first
    # checkpoint after its recovery was ckpt-85, so 450 leaves 5x that; the restarted
    # job trains the rest.
    max_steps, every = 450, 50
    job = Launched(tmp_path, ["--workers", "2", "--ps", "1", "--restarts", "1"],
                   small_run(tmp_path, "parameter_server", max_steps, every, "--epochs", "20",
                             *PINNED, "--embed-dim", "32", "--hidden-dim", "64"))
    wait_for(checkpoint(tmp_path, every), "the first checkpoint", 300)
    job.kill("worker 1")
    # TF's coordinator reports the lost worker, puts its step back and uses it again.
    wait_for(lambda: "coordinator: Worker /job:worker/replica:0/task:1 has been recovered."
             in job.log, "the coordinator to take worker 1 back", 300)
    for line in ("coordinator: Worker /job:worker/replica:0/task:1 failed with",
                 "coordinator: [Worker 1] Putting back a closure after it failed."):
        assert line in job.log
    assert ("[launch] worker 1 was killed by SIGKILL; starting it again alone "
            "(restart 1 of 3); the coordinator re-schedules its steps") in job.log
    assert "restarting the whole job" not in job.log  # the worker's loss did not stop it
    saved = latest_step(tmp_path)
    wait_for(lambda: latest_step(tmp_path) > saved, "a checkpoint after the recovery", 300)
    job.kill("ps 0")
    assert job.finish() == 0, job.log[-4000:]
    log = job.log
    assert "[launch] ps 0 was killed by SIGKILL; stopping the job" in log
    assert "[launch] restarting the whole job (restart 1 of 1)" in log
    resumed = resumed_steps(log)
    assert resumed and saved < resumed[0] < max_steps, resumed
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["strategy"], m["workers"], m["steps"]) == ("parameter_server", 2, max_steps)
    # Applied updates, counted atomically on the ps: every scheduled step; an update the
    # lost worker applied just before it died may be applied again by the re-run step.
    assert max_steps <= iterations(tmp_path) <= max_steps + 1


@pytest.mark.cluster
def test_sigterm_to_the_parameter_server_chief_stops_the_job_and_the_restart_resumes_there(
        tmp_path):
    """SIGTERM to the chief (the coordinator) after its checkpoint of step 20: it stops at
    its next sync point N with every scheduled step done, saves ckpt-N and exits 75; the
    launcher then stops the worker and the ps, which end cleanly (status 0, one line
    each), relaunches the job, and the chief resumes from exactly N."""
    max_steps, every = 300, 20
    job = Launched(tmp_path, ["--workers", "1", "--ps", "1", "--restarts", "1"],
                   small_run(tmp_path, "parameter_server", max_steps, every, "--epochs", "20"))
    wait_for(checkpoint(tmp_path, every), "the first checkpoint", 300)
    os.kill(job.pid("chief 0"), signal.SIGTERM)
    assert job.finish() == 0, job.log[-4000:]
    log = job.log
    stopped = re.findall(r"\[chief 0\] error: preempted: SIGTERM reached the chief; the "
                         r"coordinator stopped after step (\d+) \(every scheduled step done\) "
                         r"and the checkpoint of that step is saved", log)
    assert len(stopped) == 1, log[-4000:]
    step = int(stopped[0])
    # The signal may land between the save of step 20 and that same sync point's stop
    # check (CI saw it once): the stop is then at 20, whose checkpoint is the one saved.
    assert every <= step < max_steps
    assert "[launch] chief 0 stopped for a preemption (status 75), its checkpoint saved\n" \
        in log
    for task in ("worker 0", "ps 0"):
        assert f"SIGTERM received: {task} stops serving" in log, log[-4000:]
        assert f"[launch] stopped {task}: it exited with status 0" in log
    assert "[launch] restarting the whole job (restart 1 of 1)" in log
    assert "taking over the stale lock" not in log  # the chief released it
    assert "Traceback" not in log, log[-4000:]
    assert resumed_steps(log) == [step]
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["strategy"], m["steps"]) == ("parameter_server", max_steps)
    assert iterations(tmp_path) == max_steps
