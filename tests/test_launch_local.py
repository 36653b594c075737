"""scripts/launch_local.py: usage errors, and a real 2-worker multi_worker job that
survives a SIGKILLed worker (restart, resume from the last checkpoint, same steps)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO

LAUNCH = os.path.join(REPO, "scripts", "launch_local.py")


def load_launcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_local", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2", "--", "--strategy", "mirrored"],
     "error: launch_local.py starts clusters for --strategy multi_worker or parameter_server; "
     "--strategy mirrored runs in one process: use scripts/train.py"),
    (["--workers", "2", "--", "--lr", "1"], "error: give train.py's --strategy after --"),
    (["--workers", "2", "--ps", "1", "--", "--strategy", "multi_worker"],
     "error: --ps 1: multi_worker has no parameter servers"),
    (["--workers", "2", "--ports", "7,x", "--", "--strategy", "multi_worker"],
     "error: --ports '7,x' must be comma-separated integers, one per task"),
    (["--workers", "1", "--restarts", "-1", "--", "--strategy", "multi_worker"],
     "error: --restarts must be >= 0, got -1"),
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


def test_train_flags_are_required(capsys):
    with pytest.raises(SystemExit) as e:
        load_launcher().main(["--workers", "2"])
    assert e.value.code == 2
    assert "give train.py's flags after --" in capsys.readouterr().err


def wait_for(condition, what: str, timeout: float):
    """Polls ``condition`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.mark.cluster
def test_a_killed_worker_is_restarted_and_the_run_completes(tmp_path):
    max_steps, every = 20, 5
    args = ["--workers", "2", "--restarts", "1", "--",
            "--strategy", "multi_worker", "--max-steps", str(max_steps),
            "--checkpoint-every", str(every), "--synthetic-sentences", "1000,50,50",
            "--embed-dim", "16", "--hidden-dim", "16", "--batch-size", "16",
            "--eval-batch-size", "100", "--no-progress", "--no-export",
            "--model-dir", str(tmp_path / "run"), "--metrics-json", str(tmp_path / "m.json")]
    proc = subprocess.Popen([sys.executable, LAUNCH, *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        pid = int(wait_for(lambda: next((m.group(1) for m in map(
            re.compile(r"\[launch\] started worker 1 \(pid (\d+)\)").match, list(lines)) if m),
            None), "worker 1 to start", 120))
        state = tmp_path / "run" / "checkpoints" / "checkpoint"
        wait_for(state.exists, "the first checkpoint", 300)
        os.kill(pid, signal.SIGKILL)  # mid-epoch: 1000 sentences are ~63 steps of 16
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    log = "".join(lines)
    assert proc.returncode == 0, log[-4000:]
    assert "[launch] worker 1 was killed by SIGKILL; stopping the job" in log
    assert "[launch] restarting the whole job (restart 1 of 1)" in log
    resumed = [int(s) for s in re.findall(r"\[worker 0\] .*resumed from .* \(step (\d+)\)", log)]
    assert resumed and 0 < resumed[0] < max_steps and resumed[0] % every == 0
    m = json.loads((tmp_path / "m.json").read_text())
    # The same steps as an uninterrupted run, on 2 workers. (That multi_worker learns what
    # one device learns is test_multi_worker's verify check.)
    assert (m["strategy"], m["workers"], m["replicas"], m["steps"]) == \
        ("multi_worker", 2, 2, max_steps)
    assert m["valid_ppl"] < 1541  # the vocabulary size: an untrained model's perplexity
