"""--strategy multi_worker: input sharding per worker, one-line errors, and (with real
worker processes) the same result as one device in verify_parallel."""

import json
import socket

import numpy as np
import pytest
import tensorflow as tf

from conftest import without_gpus
from tfpar.tools.cli import train_main
from tfpar.parallel.rows import per_replica
from tfpar.parallel import multi_worker


def global_batches(row_counts, length=3):
    """Batches whose rows are numbered 1, 2, ... (row id in every slot; 0 stays padding)."""
    batches, next_id = [], 1
    for rows in row_counts:
        ids = np.arange(next_id, next_id + rows, dtype=np.int32)[:, None].repeat(length, 1)
        batches.append({"inputs": ids, "targets": ids})
        next_id += rows
    return batches


@pytest.mark.parametrize("workers, local", [(2, 1), (3, 1), (2, 2)])
def test_each_worker_keeps_its_own_replicas_rows(workers, local):
    """Every global batch is split over all replicas of all workers exactly once, as
    MultiWorkerMirroredStrategy's InputContext (one input pipeline per worker) asks."""
    batches = global_batches([7, 4, 1])  # uneven, and fewer rows than replicas

    def make():
        return tf.data.Dataset.from_generator(
            lambda: iter(batches),
            output_signature={k: tf.TensorSpec([None, 3], tf.int32) for k in ("inputs", "targets")})

    per_pipeline = []
    for worker in range(workers):
        ctx = tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=worker,
                                         num_replicas_in_sync=workers * local)
        per_pipeline.append([e["targets"].numpy() for e in per_replica(make(), ctx)])
    for worker_slices in per_pipeline:
        assert len(worker_slices) == len(batches) * local  # `local` slices per global batch
    for k, batch in enumerate(batches):
        # Replica r = worker * local + l holds rows shard_bounds(B, R)[r]: in replica
        # order they rebuild the global batch, nothing duplicated, nothing skipped.
        slices = [per_pipeline[w][k * local + l] for w in range(workers) for l in range(local)]
        real = [s for s in slices if s.any()]  # an empty shard is one row of padding
        np.testing.assert_array_equal(np.concatenate(real), batch["targets"])
        assert all(len(s) == 1 and not s.any() for s in slices if not s.any())


def test_communication_options():
    assert multi_worker.communication_options("ring").implementation == \
        tf.distribute.experimental.CommunicationImplementation.RING
    assert multi_worker.communication_options("auto").implementation == \
        tf.distribute.experimental.CommunicationImplementation.AUTO


# ----------------------------------------------------------------------------- errors
def run_train(args, capsys):
    code = train_main(args)
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def worker_config(address="127.0.0.1:1", index=0, workers=2):
    addresses = [address] + [f"127.0.0.1:{2 + i}" for i in range(workers - 1)]
    return json.dumps({"cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": index}})


@pytest.mark.parametrize("tf_config, extra, message", [
    (None, [], "error: --strategy multi_worker needs a cluster, but TF_CONFIG is not set"),
    ("{'cluster': 1}", [], "error: TF_CONFIG is not valid JSON"),
    ('{"task": {"type": "worker", "index": 0}}', [], 'error: TF_CONFIG has no "cluster"'),
    (worker_config(index=5), [], "error: TF_CONFIG task index 5 is out of range"),
    (worker_config(), ["--cluster", "slurm"],
     "error: --cluster slurm: this process is not a task of a Slurm job step (SLURM_PROCID"),
    (worker_config(), ["--cluster", "k8s"],
     "error: unknown cluster 'k8s'; expected one of: auto, tf_config, slurm"),
    pytest.param(worker_config(), ["--communication", "nccl"],
                 "error: --communication nccl needs GPUs on every worker, but this worker has "
                 "none", marks=without_gpus),
    pytest.param(worker_config(), ["--cpu-devices", "2"],
                 "error: --cpu-devices 2: multi_worker runs one replica per worker on a host "
                 "without GPUs", marks=without_gpus),
])
def test_cluster_errors_are_one_line(tf_config, extra, message, tiny_args, monkeypatch, capsys):
    for name in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    code, last = run_train(tiny_args + ["--strategy", "multi_worker"] + extra, capsys)
    assert code == 2
    assert last.startswith(message)


def test_a_taken_port_of_this_task_is_refused(tiny_args, monkeypatch, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setenv("TF_CONFIG", worker_config(f"127.0.0.1:{port}"))
        code, last = run_train(tiny_args + ["--strategy", "multi_worker"], capsys)
    assert code == 2
    assert last == (f"error: port {port} of this task's address 127.0.0.1:{port} is already in "
                    "use; stop the process holding it or give this task another port")


# ----------------------------------------------------------------------------- processes
@pytest.mark.cluster
@pytest.mark.parametrize("softmax", [[], ["--softmax", "sampled", "--num-sampled", "10"]],
                         ids=["full", "sampled"])
def test_two_worker_processes_match_one_device(tmp_path, capsys, softmax):
    """verify_parallel's multi_worker runner starts 2 worker processes on loopback; their
    parameters and eval perplexity must match the default strategy's. With the sampled
    softmax both workers draw the step's candidates alike."""
    from tfpar.tools.verify import main as verify_main

    report = tmp_path / "verify.json"
    assert verify_main(["--strategies", "default,multi_worker:2", "--steps", "10",
                        "--json", str(report), *softmax]) == 0
    rows = {r["strategy"]: r for r in json.loads(report.read_text())}
    assert rows["multi_worker"]["replicas"] == 2
    assert rows["multi_worker"]["max_abs_param_diff"] <= 1e-5
    assert rows["multi_worker"]["eval_ppl_rel_diff"] <= 1e-6
    captured = capsys.readouterr()
    assert "[worker 1]" in captured.err  # the workers' logs, prefixed
    # The automatic clip norm (the median of the first steps' gradient norms) clipped
    # some of the 10 steps and not others: the report's "clipped" column.
    clipped = [line.split()[4] for line in captured.out.splitlines()
               if line.startswith("multi_worker ")]
    assert len(clipped) == 1 and 0 < int(clipped[0].split("/")[0]) < 10, captured.out


@pytest.mark.cluster
def test_two_worker_processes_carry_the_stream_state_of_one_device(tmp_path):
    """--mode stream: verify's multi_worker runner (2 worker processes, 5 of the 10 rows
    each) against one device, for verify's 10 steps with its automatic clip norm: clipped
    and unclipped steps, the same norms, weights, momentum slots and eval, and the same
    recurrent state carried out of the last window (each worker's rows, gathered)."""
    from conftest import REPO
    from equivalence import Run, assert_equivalent, run_with_state
    from tfpar.config import DistConfig
    from tfpar.tools import verify

    setup = verify.build_setup(verify.VerifySpec(strategies=(("multi_worker", 2),),
                                                 mode="stream"))
    assert setup.clip_norm_auto and setup.spec.steps == 10
    ref = run_with_state(verify.run_plugin, setup, DistConfig())

    state_path = str(tmp_path / "state.npz")
    real_run_job = verify.run_job

    def run_job(make_plan, command, out):  # each worker records its steps, the chief saves
        def recorded(task):
            python, flag, code = command(task)
            return [python, flag, f"import sys; sys.path.insert(0, {REPO + '/tests'!r}); "
                                  f"from equivalence import record_worker; "
                                  f"record_worker({code!r}, {state_path!r})"]
        return real_run_job(make_plan, recorded, out=out)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify, "run_job", run_job)
        result = verify.run_multi_worker(setup, 2)
    with np.load(state_path) as saved:
        state = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    assert_equivalent(Run(result, state), ref, setup)
