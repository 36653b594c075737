"""The parallel_do strategy (PaddlePaddle's ParallelDo: split, run on every device, merge)
computes what one device computes, and runs each shard where it says.

Both runs start from the same weights, take the same batches with Adam, and alternate a
clipped step (clip norm below the gradient norm) and an unclipped one (clip norm above
it): on a clipped step, and under Adam's scale-free update, a gradient off by a constant
factor gives the same weights, so the unclipped steps and Adam's moments are what catch
it. Sentence batches have 10 rows on 4 devices (3/3/2/2) and one batch has 3 rows (one
device gets none); stream windows carry the recurrent state from window to window.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    assert_replicas_placed, batch_of, make_lines, max_diff, model_config, placed_ops, slots_of)

from tfpar.config import DataConfig, DistConfig
from tfpar.data.pipeline import InputData
from tfpar.data.vocab import Vocab
from tfpar.model.lm import build_model
from tfpar.parallel.registry import build_strategy
from tfpar.parallel.parallel_do import ParallelDo
from tfpar.training.loop import evaluate
from tfpar.objective.step import make_eval_step, make_train_step

MODEL = model_config(embed_dim=16, hidden_dim=16)
BATCH = 10
CPU = [f"/device:CPU:{i}" for i in range(4)]
LR = 0.01
LOW_CLIP = 0.01  # Below every gradient norm here (asserted): the step is clipped.
HIGH_CLIP = 100.0  # Above every gradient norm (asserted): factor 1, the step is not.
# One clip norm per step, clipped and unclipped in turn, for 12 steps (equivalence.STEPS,
# the step count of the other equivalence tests).
CLIPS = (LOW_CLIP, HIGH_CLIP) * 6


@functools.lru_cache(maxsize=None)
def setup(mode):
    lines = make_lines(160, seed=0)
    data = InputData({"train": lines, "valid": make_lines(30, seed=1), "test": lines[:5]},
                     Vocab.build(lines), DataConfig(mode=mode, bptt=6, max_length=20), seed=1)
    weights = build_model(MODEL, len(data.vocab), seed=0).get_weights()
    return data, weights


def train_batches(mode):
    """Sentence: 10-row batches, the last one 3 rows (an empty shard on 4 devices);
    stream: consecutive windows of each of 10 streams."""
    data, _ = setup(mode)
    batches = list(data.batches("train", training=True, epoch=0, batch_size=BATCH)
                   .take(len(CLIPS)))
    if mode == "sentence":
        batches[-1] = batch_of([[5, 6, 7, 2, 0], [8, 9, 2, 0, 0], [4, 4, 9, 9, 2]])
    return batches


def dist_config(strategy):
    if strategy == "default":
        return DistConfig()
    return DistConfig(strategy="parallel_do", devices=tuple(CPU))


def build(plugin, mode):
    data, weights = setup(mode)
    with plugin.scope():
        # As training builds it: with fixed shapes (XLA-compiled parts, one compilation
        # per shape) only in stream mode, whose windows have one shape; sentence mode's
        # buckets run TF's kernels (fixed shapes there compiled every new bucket shape of
        # every shard: seconds a step).
        model = build_model(MODEL, len(data.vocab), seed=0, fixed_shapes=mode == "stream")
        model.set_weights(weights)
        optimizer = keras.optimizers.Adam(LR)
        optimizer.build(model.trainable_variables)
    return model, optimizer


@functools.lru_cache(maxsize=None)
def trained(strategy, mode):
    """Trains len(CLIPS) Adam steps, then evaluates valid with the plug-in's eval step;
    returns the norms, weights, optimizer variables and eval totals (cached)."""
    plugin = build_strategy(dist_config(strategy))
    model, optimizer = build(plugin, mode)
    steps = {clip: make_train_step(plugin, model, optimizer, clip_norm=clip)
             for clip in set(CLIPS)}
    state, norms, rows = None, [], []
    for batch, clip in zip(train_batches(mode), CLIPS):
        out = steps[clip](batch, state)
        state = out.state if mode == "stream" else None
        norms.append(float(out.grad_norm))
        rows.append(int(batch["targets"].shape[0]))
    data, _ = setup(mode)
    eval_step = make_eval_step(plugin, model)
    evals = {size: evaluate(plugin, eval_step, data, "valid", size) for size in (BATCH, 3)}
    return dict(norms=norms, rows=rows, weights=model.get_weights(),
                slots=slots_of(optimizer),
                evals=evals, final_state=state)


@pytest.mark.parametrize("mode", ["sentence", "stream"])
def test_parallel_do_matches_default_weights_and_adam_slots(mode):
    ref, got = trained("default", mode), trained("parallel_do", mode)
    # Clipped and unclipped steps, in turn.
    assert [n > LOW_CLIP for n in ref["norms"]] == [True] * len(CLIPS)
    assert max(ref["norms"]) < HIGH_CLIP
    # Uneven shards on 4 devices; in sentence mode a batch with fewer rows than devices.
    assert all(r % 4 for r in got["rows"])
    assert (min(got["rows"]) < 4) == (mode == "sentence")
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=1e-5)
    assert max_diff(ref["weights"], setup(mode)[1]) > 1e-3  # Training moved them.
    assert max_diff(got["weights"], ref["weights"]) <= 1e-5
    # Adam's variables: step count, learning rate, then a first and a second moment per
    # weight, all compared.
    assert len(got["slots"]) == len(ref["slots"]) == 2 + 2 * len(ref["weights"])
    assert int(got["slots"][0]) == len(CLIPS)
    assert max_diff(got["slots"], ref["slots"]) <= 1e-5
    if mode == "stream":  # The state carried out of the last window, all 10 rows.
        for s, r in zip(tf.nest.flatten(got["final_state"]),
                        tf.nest.flatten(ref["final_state"])):
            assert s.shape == (BATCH, MODEL.hidden_dim)
            np.testing.assert_allclose(s.numpy(), r.numpy(), atol=1e-5)


@pytest.mark.parametrize("mode", ["sentence", "stream"])
def test_parallel_do_eval_matches_default(mode):
    """Eval of the trained weights over valid, in batches of 10 rows and of 3 (fewer rows
    than devices: one shard empty), gives one device's totals."""
    ref, got = trained("default", mode), trained("parallel_do", mode)
    for size in (BATCH, 3):
        (ref_nll, ref_count), (nll, count) = ref["evals"][size], got["evals"][size]
        assert count == ref_count > 0
        assert nll == pytest.approx(ref_nll, rel=1e-6)


def test_builder_takes_devices_and_puts_variables_on_the_first():
    plugin = build_strategy(DistConfig(strategy="parallel_do", devices=("/cpu:1", "/cpu:2")))
    assert isinstance(plugin, ParallelDo) and plugin.name == "parallel_do"
    assert plugin.devices == CPU[1:3] and plugin.num_replicas == 2
    assert plugin.variable_device == CPU[1]


SPEC = {"inputs": tf.TensorSpec([None, None], tf.int32),
        "targets": tf.TensorSpec([None, None], tf.int32)}
ASSIGNS = {"AssignSubVariableOp", "AssignAddVariableOp", "AssignVariableOp"}


def test_traced_step_runs_each_shard_on_its_device():
    """Shard i's forward and gradient ops (scope replica_i, the RNN loops inside included)
    on device i; the sum and Adam's updates on the variable device (here a fourth one)."""
    plugin = ParallelDo(CPU[:3], variable_device=CPU[3])
    model, optimizer = build(plugin, "sentence")
    for v in model.trainable_variables + optimizer.variables:
        assert v.value.device.endswith("CPU:3"), v.path
    step = make_train_step(plugin, model, optimizer, clip_norm=1.0)
    ops = placed_ops(step.function.get_concrete_function(SPEC).graph.as_graph_def(),
                     ParallelDo.replica_scope)
    assert_replicas_placed(ops, CPU[:3])
    sums = [d for n, d, _ in ops if n.name.startswith("controller_reduce/")]
    assert sums and set(sums) == {CPU[3]}
    updates = [device for node, device, _ in ops if node.op in ASSIGNS]
    assert len(updates) >= 2 * len(model.trainable_variables)  # Weights and Adam's moments.
    assert set(updates) == {CPU[3]}
