"""Start a TensorFlow cluster on this machine: real processes talking gRPC over 127.0.0.1.

    tfpar-launch --workers 2 -- --strategy multi_worker --max-steps 300
    tfpar-launch --workers 2 --ps 1 -- --strategy parameter_server
    tfpar-launch --workers 2 --restarts 1 -- --strategy multi_worker \\
        --model-dir runs/mw --checkpoint-every 50

Everything after ``--`` is passed unchanged to every training process (``tfpar-train``,
run as ``python -m tfpar.tools.train``); each process learns its role from the
``TF_CONFIG`` this command writes for it:

  multi_worker      N "worker" tasks; worker 0 is the chief (no separate chief task).
  parameter_server  one "chief" (the coordinator, which trains, evaluates and writes),
                    N "worker" tasks and M "ps" tasks (--ps, default 1) that only serve.

Free loopback ports are picked for every attempt (or given with --ports, one per task in
the order chief, workers, ps). Output is streamed with a ``[worker 1] `` prefix. When a
task fails every other one is stopped and the exit status is non-zero; with
--restarts K the whole job is started again, up to K times, and resumes from the
checkpoints in --model-dir (chosen here when not given, so every task and restart
shares it; --checkpoint-every N bounds the steps a failure loses). A task exiting with
status 2 (a usage error) is not restarted.

multi_worker and stop signals: SIGTERM (or SIGINT) to any worker stops every worker
after the same step; each saves the job's checkpoint of that step and exits with status
75. The job is then restarted like a failed one (a restart of --restarts) and resumes
from that step; with no restart left this command exits 75 and says to run it again.

SIGTERM (or Ctrl-C) to this command is passed on as one SIGTERM to every worker (or the
parameter_server chief): the job stops as preempted, is not restarted, and this command
exits 75; a second signal stops every task at once.

parameter_server and stop signals: SIGTERM (or SIGINT) to the chief stops the job: the
chief checkpoints at its next sync point and exits 75, the worker and ps tasks are then
sent SIGTERM and end with status 0, and the job is restarted like a preempted one.

A parameter_server worker that fails is started again alone, on its port
(--worker-restarts times at most): the chief's coordinator re-schedules the steps it
lost and uses it again once it is back, so the job goes on without a restart.

On a real cluster, run the same ``tfpar-train`` flags on every machine with
TF_CONFIG set by you (or your scheduler), e.g. for the second of two workers::

    TF_CONFIG='{"cluster": {"worker": ["host1:2222", "host2:2222"]},
                "task": {"type": "worker", "index": 1}}' \\
        tfpar-train --strategy multi_worker --model-dir /shared/run1 ...

--model-dir must then be storage every task can read (a network file system, GCS):
workers other than the chief restore from the chief's checkpoints. Parameter-server
worker and ps tasks serve until they are sent SIGTERM; send it when the chief exits.
"""

from __future__ import annotations

import argparse
from tfpar.tools.parsing import Parser
import os
import sys
from typing import Sequence


def parser(prog: str = "tfpar-launch") -> argparse.ArgumentParser:
    p = Parser(
        allow_abbrev=False, prog=prog,
        usage="%(prog)s --workers N [--ps M] [--restarts K] [--ports LIST] "
              "[--gpus-per-task G] -- <tfpar-train flags>",
        description=__doc__.split("\n\n")[0].strip(),
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, required=True,
                   help="worker tasks (multi_worker: all of them train; worker 0 is the chief)")
    p.add_argument("--ps", type=int, default=None,
                   help="parameter_server: ps tasks holding the variables (default: 1)")
    p.add_argument("--restarts", type=int, default=0,
                   help="restart the whole job up to K times after a failure (default: 0)")
    p.add_argument("--worker-restarts", type=int, default=3,
                   help="parameter_server: start a failed worker again alone, up to K times "
                        "per job, while the others go on (default: 3)")
    p.add_argument("--ports", default="",
                   help="comma-separated loopback ports, one per task in the order chief, "
                        "workers, ps (default: free ports picked for every attempt)")
    p.add_argument("--gpus-per-task", type=int, default=0,
                   help="give each chief/worker task G GPUs of its own (CUDA_VISIBLE_DEVICES: "
                        "worker 1 of 2 with G=2 gets 2,3; ps tasks get none; default 0: "
                        "every task sees every GPU)")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-launch``: 0, else the failed task's status (2 on a usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    launcher = parser(prog or "tfpar-launch")
    args = launcher.parse_args(argv[:split])  # --help exits here
    if split == len(argv):
        launcher.error("give tfpar-train's flags after --, e.g. -- --strategy multi_worker")
    train_args = argv[split + 1:]

    from tfpar.errors import ClusterError
    from tfpar.parallel.cluster.local_job import (PREEMPTED, flag_value, plan_job, run_job,
                                                  train_args_for_cluster, train_command)
    from tfpar.parallel.cluster.tf_config import JOBS
    from tfpar.tools.cli import run_main

    def body():
        for flag in ("restarts", "worker_restarts", "gpus_per_task"):
            if getattr(args, flag) < 0:
                raise ClusterError(f"--{flag.replace('_', '-')} must be >= 0, "
                                   f"got {getattr(args, flag)}")
        strategy, flags = train_args_for_cluster(train_args)
        # Default: one ps task where the strategy's cluster needs ps tasks.
        ps = args.ps if args.ps is not None else int("ps" in JOBS[strategy]["required"])
        try:
            ports = [int(p) for p in args.ports.split(",") if p.strip()] or None
        except ValueError:
            raise ClusterError(f"--ports {args.ports!r} must be comma-separated "
                               "integers, one per task") from None

        def plan():
            return plan_job(strategy, workers=args.workers, ps=ps, ports=ports)

        plan().release()  # bad counts or taken ports fail here, before anything starts
        print(f"[launch] {strategy}: {args.workers} worker(s)"
              f"{f', {ps} ps' if ps else ''}; model dir {flag_value(flags, '--model-dir')}",
              flush=True)
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        status = run_job(plan, train_command(flags),
                         restarts=args.restarts, env=env,
                         task_restarts=args.worker_restarts,
                         gpus_per_task=args.gpus_per_task)
        if status == PREEMPTED:
            print(f"error: the {strategy} job was preempted (status {status}): every worker "
                  "stopped after the same step and its checkpoint is saved in "
                  f"{flag_value(flags, '--model-dir')}; run the same command again to resume "
                  "(--restarts K relaunches it by itself)", file=sys.stderr)
        elif status:
            print(f"error: the {strategy} job failed (status {status}); see the log above",
                  file=sys.stderr)
        return status

    return run_main(body)


if __name__ == "__main__":
    from tfpar.tools.commands import start

    sys.exit(start("tfpar.tools.launch"))
