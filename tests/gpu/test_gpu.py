"""The GPU suite: what only a GPU host can show. ``make gpu-check`` runs it
(TFPAR_GPU_TESTS=1, GPUs visible); ``make test`` does not collect it (tests/conftest.py).

Written to run as it is on a host with 1-8 NVIDIA GPUs in a few minutes; every test that
needs more GPUs than the host has skips with its reason. Prints (``-s``) what a reader
wants to see: the devices, the verify table, tokens/s of cuDNN against the fast CPU
recurrence placed on the same GPU.
"""

import dataclasses
import json
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import PINNED, model_config
from tfpar.model import layers
from tfpar.model.lm import build_model
from tfpar.objective.losses import nll_sum_and_count
from tfpar.tools.cli import train_main

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


def test_mirrored_trains_on_every_gpu(tmp_path):
    metrics = tmp_path / "m.json"
    assert train_main(["--strategy", "mirrored", "--synthetic-sentences", "400,40,40", *PINNED,
                       "--max-steps", "20", "--no-progress", "--no-export",
                       "--model-dir", str(tmp_path / "run"), "--metrics-json",
                       str(metrics)]) == 0
    m = json.loads(metrics.read_text())
    assert m["replicas"] == len(GPUS) and m["steps"] == 20
    print(f"gpu-check: mirrored on {len(GPUS)} GPU(s): valid ppl {m['valid_ppl']:.2f}")


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
