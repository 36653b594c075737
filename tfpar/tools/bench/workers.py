"""The scaling model's check on this host: N multi_worker processes on loopback.

``measure_loopback(spec, n)`` starts ``n`` processes (``python -m tfpar.tools.bench
--worker-task <request>``, each with its ``TF_CONFIG``, as ``scripts/launch_local.py``
starts ``train.py``); every process builds ``MultiWorkerMirroredStrategy`` and the
benchmark's model, and then, in rounds, all of them together (a collective first lines
them up) time:

* ``step``: the real synchronous step (``step.make_train_step(plugin, ...)``): each worker computes
  on its 1/n of the global batch, the gradients are all-reduced over gRPC;
* ``compute``: the same model's step on one worker's share with no strategy (no
  all-reduce), every worker computing at once, so the cores are shared as in ``step``;
* ``allreduce``: all-reducing tensors shaped like the gradients alone (the bytes a step
  sends), and a 4 KB tensor, the two sizes :func:`tfpar.tools.bench.scaling.fit_link`
  turns into the loopback link's bandwidth and latency.

Worker 0 writes the medians to the request's JSON file and every process leaves with
``os._exit`` after a last collective (TensorFlow's teardown of a collective runtime can
wait for peers that are gone).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any, NoReturn

import numpy as np

from tfpar.tools.bench.spec import BenchSpec

SMALL_FLOATS = 1024  # the latency probe: 4 KB


def measure_loopback(spec: BenchSpec, n: int, *, rounds: int = 3, steps: int = 10
                     ) -> dict[str, Any]:
    """Runs the ``n``-process job and returns worker 0's measurements (seconds)."""
    import io

    from tfpar.errors import ClusterError
    from tfpar.parallel.cluster.local_job import package_env, plan_job, run_job

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "worker0.json")
        request = json.dumps({"spec": dataclasses.asdict(spec), "out": out_path,
                              "rounds": rounds, "steps": steps})
        command = (lambda task: [sys.executable, "-m", "tfpar.tools.bench", "--worker-task",
                                 request])
        env = package_env({**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        logs = io.StringIO()
        status = run_job(lambda: plan_job("multi_worker", workers=n), command, out=logs,
                         env=env)
        if status or not os.path.exists(out_path):
            tail = " | ".join(logs.getvalue().strip().splitlines()[-3:])
            raise ClusterError(f"the {n}-worker loopback job failed (status {status}): {tail}")
        with open(out_path, encoding="utf-8") as f:
            return json.load(f)


def _median_seconds(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def serve_worker(request: str) -> NoReturn:
    """One process of :func:`measure_loopback` (its role from ``TF_CONFIG``)."""
    import tensorflow as tf

    from tfpar.config import DistConfig
    from tfpar.parallel.registry import build_strategy
    from tfpar.tools.bench.contenders import build_tfpar
    from tfpar.tools.bench.workload import load_setup

    req = json.loads(request)
    plugin = build_strategy(DistConfig(strategy="multi_worker"))  # before anything runs
    strategy, n = plugin.strategy, plugin.num_replicas
    spec = BenchSpec(**req["spec"])
    setup = load_setup(spec)
    step, _ = build_tfpar(setup, "multi_worker", DistConfig(strategy="multi_worker"))
    share = dataclasses.replace(spec, batch_size=spec.batch_size // n)
    local, _ = build_tfpar(dataclasses.replace(setup, spec=share), "compute",
                           DistConfig(strategy="default"))
    shapes = [v.shape for v in step.model.trainable_variables]
    grad_bytes = float(sum(4 * int(np.prod(s)) for s in shapes))

    @tf.function(autograph=False)
    def allreduce(small: bool):
        def replica():
            ctx = tf.distribute.get_replica_context()
            tensors = ([tf.ones([SMALL_FLOATS])] if small
                       else [tf.ones(s) for s in shapes])
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tensors)[0]
        return strategy.run(replica)

    def barrier():
        float(strategy.experimental_local_results(allreduce(True))[0][0])

    def timed_allreduce(small: bool) -> float:
        barrier()
        return _median_seconds(
            lambda: strategy.experimental_local_results(allreduce(small))[0].numpy(), 10)

    for c in (step, local):
        c.warm_up(spec.warmup)
    timed_allreduce(True), timed_allreduce(False)  # traces
    got: dict[str, list[float]] = {"step": [], "compute": [], "allreduce": [], "small": []}
    for _ in range(req["rounds"]):
        barrier()
        got["step"].append(step.segment(req["steps"]).seconds / req["steps"])
        barrier()
        got["compute"].append(local.segment(req["steps"]).seconds / req["steps"])
        got["allreduce"].append(timed_allreduce(False))
        got["small"].append(timed_allreduce(True))
    result = {k: float(np.median(v)) for k, v in got.items()}
    result.update({"workers": n, "gradient_bytes": grad_bytes,
                   "small_bytes": 4.0 * SMALL_FLOATS, "batch_size": spec.batch_size,
                   "tokens_per_step": spec.batch_size * spec.bptt})
    if plugin.is_chief:
        with open(req["out"], "w", encoding="utf-8") as f:
            json.dump(result, f)
    barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
