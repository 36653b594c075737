"""The GPU suite: what only a GPU host can show. ``make gpu-check`` runs it
(TFPAR_GPU_TESTS=1, GPUs visible); ``make test`` does not collect it (tests/conftest.py).

Written to run as it is on a host with 1-8 NVIDIA GPUs in a few minutes; every test that
needs more GPUs than the host has skips with its reason. Prints (``-s``) what a reader
wants to see: the devices, the verify table, tokens/s of cuDNN against the fast CPU
recurrence placed on the same GPU.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import PINNED, assert_resumed_from, model_config, shared_data_dir
from faults import checkpoint_tensors
from test_export import WITHOUT_TFPAR, saved_op_types
from test_precision import loss_scale_run
from tfpar.model import layers
from tfpar.model.lm import build_model
from tfpar.objective.losses import nll_sum_and_count
from tfpar.tools.cli import train_main
from tfpar.tools.verify import TOLERANCES

pytestmark = pytest.mark.gpu
GPUS = tf.config.list_logical_devices("GPU")
if not GPUS:
    pytest.skip("no GPU visible to TensorFlow", allow_module_level=True)
print(f"\ngpu-check: {len(GPUS)} GPU(s): {', '.join(d.name for d in GPUS)}")

MODEL = model_config(embed_dim=64, hidden_dim=128, layers=2)
V = 1000


def needs(n):
    return pytest.mark.skipif(len(GPUS) < n, reason=f"needs {n} GPUs, this host has "
                                                   f"{len(GPUS)}")


def train_step_graph(model, inputs, targets):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            logits, _ = model(inputs, training=True)
            nll, count = nll_sum_and_count(logits, targets)
        return tape.gradient(nll / count, model.trainable_variables)
    return step


def op_types(concrete) -> set:
    graph = concrete.graph.as_graph_def()
    types = {n.op for n in graph.node}
    for f in graph.library.function:
        types |= {n.op for n in f.node_def}
    return types


def batch(rows=32, steps=35, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(1, V, size=(rows, steps)).astype(np.int32),
            rng.integers(1, V, size=(rows, steps)).astype(np.int32))


def test_a_two_step_run_starts_after_the_suite_started_tensorflow(tmp_path):
    """The suite's start-up: tests/conftest.py has started TensorFlow (its logical CPU
    devices) before the first ``train_main`` reaches configure_gpus, where memory growth
    can no longer be set (issue 42, failure 2: that was a RuntimeError, it is a warning).
    Two steps, tiny: ``make test`` runs this test alone with a faked GPU
    (tests/test_gpu_startup.py, tests/gpu/fake_gpu.py)."""
    metrics = tmp_path / "m.json"
    assert train_main(["--strategy", "mirrored", "--synthetic-sentences", "64,16,16", *PINNED,
                       "--embed-dim", "16", "--hidden-dim", "16",
                       "--batch-size", str(8 * len(GPUS)), "--max-steps", "2",
                       "--no-progress", "--no-export", "--model-dir", str(tmp_path / "run"),
                       "--metrics-json", str(metrics)]) == 0
    m = json.loads(metrics.read_text())
    assert m["replicas"] == len(GPUS) and m["steps"] == 2


def test_the_cudnn_kernel_is_in_the_traced_train_step():
    with tf.device("/gpu:0"):
        model = build_model(MODEL, V, seed=0)
    inputs, targets = batch()
    step = train_step_graph(model, inputs, targets)
    assert "CudnnRNNV3" in op_types(step.get_concrete_function())
    for g in step():
        assert np.all(np.isfinite(tf.convert_to_tensor(g).numpy()))


def strategy_line(log: str) -> str:
    """The start-up line ``strategy mirrored: N replica(s) on ...; all-reduce ...`` of a
    run's log, from ``strategy`` on (the one such line)."""
    lines = [x[x.index("strategy "):] for x in log.splitlines() if " strategy " in x]
    assert len(lines) == 1, lines
    return lines[0]


def test_mirrored_trains_on_every_gpu_and_logs_its_all_reduce(tmp_path, capsys,
                                                              record_testsuite_property):
    """Mirrored over every GPU; its start-up line names the all-reduce: NCCL on 2 or more
    GPUs (one GPU has nothing to sum). tests/gpu/check.py's report quotes the line."""
    metrics = tmp_path / "m.json"
    capsys.readouterr()
    assert train_main(["--strategy", "mirrored", "--synthetic-sentences", "400,40,40", *PINNED,
                       "--max-steps", "20", "--no-progress", "--no-export",
                       "--model-dir", str(tmp_path / "run"), "--metrics-json",
                       str(metrics)]) == 0
    line = strategy_line(capsys.readouterr().err)
    record_testsuite_property("all_reduce", line)
    print(f"gpu-check: {line}")
    want = ("NcclAllReduce" if len(GPUS) > 1
            else "ReductionToOneDevice (one replica: nothing to reduce)")
    assert line == (f"strategy mirrored: {len(GPUS)} replica(s) on "
                    f"{', '.join(d.name for d in GPUS)}; all-reduce {want}")
    m = json.loads(metrics.read_text())
    assert m["replicas"] == len(GPUS) and m["steps"] == 20
    print(f"gpu-check: mirrored on {len(GPUS)} GPU(s): valid ppl {m['valid_ppl']:.2f}")


@needs(2)
def test_mirrored_sums_gradients_with_nccls_op_on_every_gpu():
    """What the log line says is what runs: the plug-in's gradient sum (the one the
    training step calls), traced, holds TensorFlow's ``NcclAllReduce`` op, and each
    replica's copy is the sum over every GPU (replica r contributes r + 1)."""
    from tfpar.config import DistConfig
    from tfpar.objective.step import add
    from tfpar.parallel.registry import build_strategy

    plugin = build_strategy(DistConfig(strategy="mirrored"))
    assert isinstance(plugin.cross_device_ops, tf.distribute.NcclAllReduce)

    def contribution():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.fill([4, 3], tf.cast(r + 1, tf.float32))

    @tf.function
    def summed():
        return plugin.sum_gradients([plugin.strategy.run(contribution)], None, add)[0]

    assert "NcclAllReduce" in op_types(summed.get_concrete_function())
    n = len(GPUS)
    copies = plugin.strategy.experimental_local_results(summed())
    assert len(copies) == n
    for c in copies:
        np.testing.assert_array_equal(c.numpy(), np.full([4, 3], n * (n + 1) / 2))


def resume_args(corpus, root, name):
    """200 mirrored steps over every GPU in stream mode (the carried state gathered from
    the GPUs into the checkpoint), checkpoints every 4 steps, the GPU default of several
    steps per call, ``--deterministic``; long enough to be killed mid-run."""
    return ["--data", str(corpus), "--mode", "stream", "--bptt", "8", *PINNED,
            "--embed-dim", "16", "--hidden-dim", "64", "--dropout", "0.1",
            "--strategy", "mirrored", "--batch-size", str(8 * len(GPUS)), "--epochs", "1000",
            "--max-steps", "200", "--checkpoint-every", "4", "--deterministic", "--seed", "3",
            "--no-progress", "--no-export", "--model-dir", str(root / name),
            "--metrics-json", str(root / f"{name}.json")]


def test_a_run_killed_on_the_gpus_and_resumed_ends_equal_to_an_uninterrupted_one(
        tmp_path, record_testsuite_property):
    """tests/test_reliability.py's SIGKILL test on the GPUs: train.py mirrored over every
    GPU is killed once its checkpoint of step 8 exists, run again with the same command,
    and must say it resumed from the checkpoint the kill left and end with every tensor
    (weights, Adam's slots, counters, the carried state) bit-equal to an uninterrupted
    run's, and the same perplexities. The promise is --deterministic's
    (``tf.config.experimental.enable_op_determinism``: the same GPUs, the same software);
    tfpar/docs/gpu.md says what is not promised without it."""
    from test_reliability import assert_same_tensors, has_checkpoint, make_corpus, wait_for
    from faults import compare_tensors, latest_step, start_train

    corpus = make_corpus(tmp_path)
    whole = start_train(resume_args(corpus, tmp_path, "whole"))
    out, _ = whole.communicate(timeout=900)
    assert whole.returncode == 0, out[-3000:]
    killed = start_train(resume_args(corpus, tmp_path, "run"))
    wait_for(has_checkpoint(tmp_path / "run", 8), killed)
    killed.kill()  # SIGKILL
    killed.communicate(timeout=60)
    left = latest_step(str(tmp_path / "run"))
    assert left is not None and 4 <= left < 200, left
    resumed = start_train(resume_args(corpus, tmp_path, "run"))
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    assert_resumed_from(out, left)
    got, want = checkpoint_tensors(tmp_path / "run"), checkpoint_tensors(tmp_path / "whole")
    comparison = compare_tensors(got, want)
    result = (f"resume: killed after step {left} of 200, resumed on {len(GPUS)} GPU(s): "
              f"{comparison.describe()}")
    record_testsuite_property("resume", result)
    print(f"gpu-check: {result}")
    assert_same_tensors(got, want)
    ends = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("run", "whole")]
    assert [(m["steps"], m["valid_ppl"], m["test_ppl"]) for m in ends] == \
        [(200, ends[1]["valid_ppl"], ends[1]["test_ppl"])] * 2


def test_verify_parallel_passes_on_the_gpus_with_tf32_off(capsys):
    """TF32 (Ampere and later) rounds matmul inputs to 10 bits: verify turns it off itself
    (TensorFlow's default, on, is left here), so the GPUs compute float32 and its
    tolerances hold."""
    from tfpar.tools import verify

    assert tf.config.experimental.tensor_float_32_execution_enabled()
    n = len(GPUS)
    strategies = f"mirrored:{n},tower:{n}" if n > 1 else "mirrored:1"
    code = verify.main(["--strategies", strategies])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_trains_on_the_gpus_with_cudnn_given_16_bit_tensors(tmp_path, policy):
    """The policy's cuDNN op takes the 16-bit type (its T attribute; TensorFlow's bfloat16
    kernel then computes in float32 inside, which no attribute shows); mirrored over every
    GPU trains (mixed_float16 with loss scaling: its skipped steps are reported, not bad
    batches); verify with the policy's tolerance."""
    from tfpar.tools import verify

    config = dataclasses.replace(MODEL, precision=policy)
    with tf.device("/gpu:0"):
        model = build_model(config, V, seed=0)
    inputs, targets = batch()
    step = train_step_graph(model, inputs, targets)
    graph = step.get_concrete_function().graph
    low = tf.as_dtype(policy.removeprefix("mixed_"))
    assert any(op.type == "CudnnRNNV3" and op.get_attr("T") == low
               for op in graph.get_operations())
    metrics = tmp_path / "m.json"
    assert train_main(["--strategy", "mirrored", "--precision", policy,
                       "--synthetic-sentences", "400,40,40", *PINNED, "--max-steps", "20",
                       "--no-progress", "--no-export", "--model-dir", str(tmp_path / "run"),
                       "--metrics-json", str(metrics)]) == 0
    m = json.loads(metrics.read_text())
    assert m["steps"] == 20 and m["skipped_batches"] == 0
    print(f"gpu-check: {policy} mirrored on {len(GPUS)} GPU(s): valid ppl "
          f"{m['valid_ppl']:.2f}, {m['loss_scale_skips']} loss-scale skip(s)")
    n = len(GPUS)  # verify turns TF32 off itself
    assert verify.main(["--precision", policy, "--strategies",
                        f"mirrored:{n},tower:{n}" if n > 1 else "mirrored:1"]) == 0


def fp16_run(root, corpus, monkeypatch, steps_per_call):
    """12 mixed_float16 steps mirrored over every GPU whose first steps overflow (loss
    scale 2**28, halved by each skipped step: tests/test_precision.py's run); (metrics,
    checkpoint tensors)."""
    root.mkdir()
    args = ["--data", str(corpus), *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
            "--batch-size", str(8 * len(GPUS)), "--epochs", "50", "--max-steps", "12",
            "--strategy", "mirrored", "--steps-per-execution", str(steps_per_call),
            "--checkpoint-every", "0", "--no-progress", "--model-dir", str(root / "run"),
            "--metrics-json", str(root / "metrics.json")]
    metrics = loss_scale_run(root, args, monkeypatch, 2.0 ** 28)
    return metrics, checkpoint_tensors(root / "run")


def test_mixed_float16_mirrored_with_several_steps_per_call_trains_what_one_per_call_does(
        tiny_corpus_dir, tmp_path, monkeypatch):
    """The GPU default (several steps per tf.function call) under mixed_float16 and
    mirrored over every GPU: the first steps' loss-scale skips fall inside calls of 5;
    the run counts them as one step per call does, skips no batch, and ends with the
    same tensors: counters, integers and the loss scale exactly, the other floats within
    verify's mixed_float16 tolerance (set on CPUs; GPU reductions need not repeat bit
    for bit)."""
    one, want = fp16_run(tmp_path / "one", tiny_corpus_dir, monkeypatch, 1)
    five, got = fp16_run(tmp_path / "five", tiny_corpus_dir, monkeypatch, 5)
    for m in (one, five):
        assert m["steps"] == 12 and m["skipped_batches"] == 0 and m["loss_scale_skips"] >= 3
    assert five["loss_scale_skips"] == one["loss_scale_skips"]
    assert sorted(got) == sorted(want)
    # The steps applied (skipped ones are not), and the scale the skips left: exactly.
    assert int(got["optimizer/inner_optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 12
    exact = {"moments/dynamic_scale/.ATTRIBUTES/VARIABLE_VALUE"}
    assert exact <= set(want)
    tolerance = TOLERANCES["mixed_float16"][0]
    for key, value in want.items():
        if np.issubdtype(value.dtype, np.floating) and key not in exact:
            np.testing.assert_allclose(got[key], value, rtol=tolerance, atol=tolerance,
                                       err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    print(f"gpu-check: mixed_float16 mirrored on {len(GPUS)} GPU(s), 5 steps per call: "
          f"{five['loss_scale_skips']} loss-scale skip(s) as with 1, the same tensors")


# A serving process with no GPU: it says so after serving (tests/test_export.py's script).
NO_GPU = '\nassert not tf.config.list_physical_devices("GPU"), "the child sees a GPU"\n'


def test_an_export_trained_on_the_gpus_serves_in_a_fresh_process_without_a_gpu(tiny_args,
                                                                                tmp_path):
    """Issue 42, failure 4, on a GPU host: trained mirrored over every GPU and exported,
    the SavedModel holds no Cudnn* op (GPU kernels only), and a fresh process with
    CUDA_VISIBLE_DEVICES= (and no tfpar) loads it, scores and generates; its scores equal
    the same SavedModel's served here on the GPUs."""
    assert train_main([*tiny_args, "--strategy", "mirrored",
                       "--batch-size", str(8 * len(GPUS))]) == 0
    path = json.loads((tmp_path / "metrics.json").read_text())["export_path"]
    assert not [op for op in saved_op_types(path) if op.startswith("Cudnn")]
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TFPAR + NO_GPU, path],
                          capture_output=True, text=True, cwd="/", timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "",
                               "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == [4, 2] and got["text"] == got["again"] and got["modules"] == []
    here = tf.saved_model.load(path).signatures["score"](text=tf.constant(["w1 w2 w3", "w4"]))
    np.testing.assert_allclose(got["nll"], here["nll"].numpy(), rtol=1e-5)
    print(f"gpu-check: an export trained on {len(GPUS)} GPU(s) serves with no GPU visible")


@needs(2)
def test_the_pipeline_runs_on_two_gpus(tmp_path):
    metrics = tmp_path / "m.json"
    assert train_main(["--strategy", "pipeline", "--stages",
                       "embedding=/gpu:0,rnn=/gpu:1,softmax=/gpu:1",
                       "--synthetic-sentences", "400,40,40", *PINNED, "--max-steps", "10",
                       "--no-progress", "--no-export", "--model-dir", str(tmp_path / "run"),
                       "--metrics-json", str(metrics)]) == 0
    assert json.loads(metrics.read_text())["steps"] == 10


def test_tokens_per_second_of_cudnn_and_of_the_fast_recurrence(monkeypatch):
    """Prints both (no assert on time: the suite measures, the README reports)."""
    inputs, targets = batch(rows=64, steps=35)
    rates = {}
    for name in ("cudnn", "fast"):
        with monkeypatch.context() as patch:
            if name == "fast":
                patch.setattr(layers, "runs_on_gpu", lambda probe: False)
            with tf.device("/gpu:0"):
                model = build_model(MODEL, V, seed=0)
            step = train_step_graph(model, inputs, targets)
            step()  # trace and warm up
            started = time.perf_counter()
            for _ in range(20):
                grads = step()
            float(tf.convert_to_tensor(grads[0])[0, 0])  # wait for the GPU
            rates[name] = 20 * inputs.size / (time.perf_counter() - started)
    print(f"gpu-check: train step tokens/s on /gpu:0: cuDNN {rates['cudnn']:,.0f}, fast "
          f"recurrence {rates['fast']:,.0f} ({rates['cudnn'] / rates['fast']:.1f}x)")
    assert all(r > 0 for r in rates.values())


def test_tokens_per_second_of_mirrored_on_one_gpu_and_on_every_gpu(record_testsuite_property):
    """The benchmark's machinery (tests/bench_gpus.py) on the GPUs: its model
    (ptb_word_lm's small one: 2 layers of 200, a 10k vocabulary; the generated corpus
    where ../shared/data/ptb is missing), 64 rows per GPU, training's 20 steps per call
    on GPUs, 3 interleaved rounds of 40 steps. A measurement for the report: no time is
    asserted, only that each contender trained on the GPUs it was given."""
    from bench_gpus import device_scaling, format_line
    from tfpar.tools.bench.spec import quick_spec
    from tfpar.tools.bench.workload import load_setup
    from tfpar.training.run import GPU_STEPS_PER_EXECUTION

    names = [d.name for d in GPUS]
    sets = {"one": names[:1], "every": names} if len(names) > 1 else {"one": names}
    ptb = os.path.join(shared_data_dir(), "ptb")  # the benchmark's default is input/ptb
    data = ptb if os.path.isdir(ptb) else "synthetic"
    results = device_scaling(load_setup(quick_spec(steps=40, data=data)), sets,
                             rows_per_device=64, steps_per_execution=GPU_STEPS_PER_EXECUTION)
    line = format_line(results)
    record_testsuite_property("tokens_per_sec", line)
    print(f"gpu-check: {line}")
    assert [r["devices"] for r in results.values()] == list(sets.values())
