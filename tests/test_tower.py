"""The tower strategy: equal to one device, placement on the traced graph, errors, CLI."""

import functools
import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import (
    assert_replicas_placed, batch_of, make_lines, max_diff, model_config, placed_ops, slots_of, small_config, train_config)
from equivalence import assert_equivalent, make_setup, run_with_state
import tensorflow as tf

from tfpar.tools import cli
from tfpar.config import DataConfig, DistConfig
from tfpar.errors import DeviceError
from tfpar.data.pipeline import InputData
from tfpar.model.lm import build_model
from tfpar.objective.step import make_eval_step, make_train_step
from tfpar.parallel.registry import build_strategy
from tfpar.parallel.tower import TowerPlugin, default_variable_device, ring_all_reduce
from tfpar.training.schedule import EpochSchedule, base_learning_rate
from tfpar.tools.verify import run_plugin
from tfpar.data.vocab import Vocab

MODEL = model_config(embed_dim=16, hidden_dim=16)
# The clip norm of the empty-shard tests below, under their first step's gradient norm
# (asserted). The runs compared with default use verify's automatic one (equivalence).
CLIP = 0.155
BATCH = 10  # 10 rows: 3 towers get 4/3/3, 4 towers 3/3/2/2.
CPU = [f"/device:CPU:{i}" for i in range(4)]


def setup(mode="sentence"):
    """The set-up of one mode (cached whichever way it is called)."""
    return cached_setup(mode)


@functools.lru_cache(maxsize=None)
def cached_setup(mode):
    """Data, initial weights and run settings shared by every run of one mode: STEPS
    steps, the median of the first steps' gradient norms as the clip norm (so some steps
    are clipped and some not, asserted: on a clipped step a gradient off by a constant
    factor gives the very same update, so only the unclipped ones (and the norms) can
    tell a wrong gradient from a right one)."""
    lines = make_lines(160)
    data = InputData({"train": lines, "valid": make_lines(30, seed=1), "test": lines[:5]},
                     Vocab.build(lines), DataConfig(mode=mode, bptt=6, max_length=20), seed=1)
    return make_setup(data, MODEL, mode, batch_size=BATCH)


@functools.lru_cache(maxsize=None)
def run(strategy="default", towers=1, reduce="controller", mode="sentence"):
    """Trains STEPS steps from the shared initial weights (cached: runs are reused);
    returns the result and the state carried out of the last window (stream mode)."""
    dist = DistConfig()
    if strategy == "tower":
        dist = DistConfig(strategy="tower", devices=tuple(CPU[:towers]), tower_reduce=reduce)
    return run_with_state(run_plugin, setup(mode), dist)


# ----------------------------------------------------------------- equal to one device
@pytest.mark.parametrize("towers,reduce", [
    (1, "controller"), (2, "controller"), (3, "controller"), (4, "controller"),
    (2, "ring"), (3, "ring"), (4, "ring"),
])
def test_tower_matches_default_with_clipping(towers, reduce):
    assert_equivalent(run("tower", towers, reduce), run(), setup())


@pytest.mark.parametrize("towers", [3, 4])
def test_ring_and_controller_give_the_same_update(towers):
    ring, controller = run("tower", towers, "ring"), run("tower", towers, "controller")
    assert max_diff(ring.result.weights, controller.result.weights) <= 1e-6
    assert max_diff(ring.result.slots, controller.result.slots) <= 1e-6


@pytest.mark.parametrize("towers,reduce", [(3, "ring"), (4, "controller")])
def test_tower_stream_mode_carries_state_like_default(towers, reduce):
    """Weights, slots and the state carried out of the last window (10 rows over 3
    towers 4/3/3, over 4 towers 3/3/2/2), all equal to one device's."""
    assert_equivalent(run("tower", towers, reduce, mode="stream"), run(mode="stream"),
                      setup("stream"))


@pytest.mark.parametrize("towers", [2, 3, 4])
def test_ring_all_reduce_sums_on_every_device(towers):
    rng = np.random.default_rng(towers)
    values = [rng.normal(size=11).astype(np.float32) for _ in range(towers)]
    vectors = []
    for device, v in zip(CPU, values):
        with tf.device(device):
            vectors.append(tf.constant(v))
    out = ring_all_reduce(vectors, CPU[:towers])
    assert len(out) == towers
    for device, o in zip(CPU, out):
        assert o.device.endswith(device.split("device:")[1])
        np.testing.assert_allclose(o.numpy(), np.sum(values, axis=0), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------- empty shards
def build(plugin_or_dist, momentum=0.0):
    plugin = (plugin_or_dist if isinstance(plugin_or_dist, TowerPlugin)
              else build_strategy(plugin_or_dist))
    with plugin.scope():
        model = build_model(MODEL, len(setup().data.vocab), seed=0)
        model.set_weights(setup().initial_weights)
        optimizer = keras.optimizers.SGD(0.5, momentum=momentum)
        optimizer.build(model.trainable_variables)
    return plugin, model, optimizer


def fresh(plugin_or_dist, clip=CLIP):
    plugin, model, optimizer = build(plugin_or_dist)
    return plugin, model, make_train_step(plugin, model, optimizer, clip_norm=clip)


def clipped_then_unclipped(dist, batch):
    """Two SGD-momentum steps on ``batch``: clipped to CLIP, then with no clipping (0).
    Returns both steps' outputs, the weights and the optimizer's variables."""
    plugin, model, optimizer = build(dist, momentum=0.5)
    outs = [make_train_step(plugin, model, optimizer, clip_norm=clip)(batch)
            for clip in (CLIP, 0.0)]
    return outs, model.get_weights(), slots_of(optimizer)


@pytest.mark.parametrize("name,rows,towers", [
    # Fewer rows than towers: towers 2 and 3 get no rows at all.
    ("fewer rows than towers", [[5, 6, 7, 2], [8, 9, 2, 0]], 4),
    # Tower 1's rows (the last two of four) are all padding: it holds no tokens.
    ("a tower of padding", [[5, 6, 7, 2], [8, 9, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]], 2),
])
def test_zero_token_shards_give_the_default_update(name, rows, towers):
    batch = batch_of(rows)
    ref_outs, ref_weights, ref_slots = clipped_then_unclipped(DistConfig(), batch)
    outs, weights, slots = clipped_then_unclipped(
        DistConfig(strategy="tower", devices=tuple(CPU[:towers])), batch)
    assert float(ref_outs[0].grad_norm) > CLIP  # The first step is clipped, not the second.
    for out, ref_out in zip(outs, ref_outs):
        assert np.isfinite(float(out.grad_norm))
        assert float(out.grad_norm) == pytest.approx(float(ref_out.grad_norm), rel=1e-5)
        assert float(out.count) == float(ref_out.count) == float((np.array(rows) != 0).sum())
        assert float(out.nll_sum) == pytest.approx(float(ref_out.nll_sum), rel=1e-6)
    assert max_diff(weights, ref_weights) <= 1e-6
    assert len(slots) == len(weights) + 2 and max_diff(slots, ref_slots) <= 1e-6
    assert all(np.isfinite(w).all() for w in weights)


def test_eval_state_with_empty_towers_keeps_the_global_rows():
    """Stream eval with 3 rows on 4 towers: the state comes back as [3, H] per tensor and
    equals one device's."""
    batch = batch_of([[5, 6, 7], [8, 9, 2], [4, 4, 4]])
    plugin, model, _ = fresh(DistConfig(strategy="tower", devices=tuple(CPU)))
    ref_plugin, ref_model, _ = fresh(DistConfig())
    step, ref_step = make_eval_step(plugin, model), make_eval_step(ref_plugin, ref_model)
    state = ref_state = None
    for _ in range(2):  # The second window starts from the carried state.
        out, ref = step(batch, state), ref_step(batch, ref_state)
        state, ref_state = out.state, ref.state
        assert float(out.nll_sum) == pytest.approx(float(ref.nll_sum), rel=1e-6)
        for s, r in zip(tf.nest.flatten(state), tf.nest.flatten(ref_state)):
            assert s.shape == (3, MODEL.hidden_dim)
            np.testing.assert_allclose(s.numpy(), r.numpy(), atol=1e-6)


# ----------------------------------------------------------------- placement
SPEC = {"inputs": tf.TensorSpec([None, None], tf.int32),
        "targets": tf.TensorSpec([None, None], tf.int32)}
ASSIGNS = {"AssignSubVariableOp", "AssignAddVariableOp", "AssignVariableOp"}


@pytest.mark.parametrize("reduce", ["controller", "ring"])
def test_traced_step_places_towers_and_updates(reduce):
    plugin = build_strategy(DistConfig(strategy="tower", devices=tuple(CPU[:3]),
                                       variable_device="/cpu:3", tower_reduce=reduce))
    assert plugin.variable_device == CPU[3]
    _, model, step = fresh(plugin)
    for v in model.trainable_variables:
        assert v.value.device.endswith("CPU:3")
    ops = placed_ops(step.function.get_concrete_function(SPEC).graph.as_graph_def(), "tower")
    assert_replicas_placed(ops, CPU[:3])

    updates = [device for node, device, _ in ops if node.op in ASSIGNS]
    assert len(updates) >= len(model.trainable_variables)
    assert set(updates) == {CPU[3]}

    if reduce == "controller":
        sums = [d for n, d, _ in ops if n.name.startswith("controller_reduce/")]
        assert sums and set(sums) == {CPU[3]}
    else:
        # 2 reduce-scatter and 2 all-gather steps of 3 transfers, each op on the receiver.
        adds = [d for n, d, _ in ops if n.name.startswith("ring_reduce_scatter")
                and n.op == "AddV2"]
        gathers = [d for n, d, _ in ops if n.name.startswith("ring_all_gather")
                   and n.op == "Identity"]
        assert sorted(adds) == sorted(gathers) == sorted(CPU[:3] * 2)


PLACEMENT_SCRIPT = """
import tensorflow as tf
from tfpar.tools.cli import prepare_runtime
from tfpar.config import DistConfig, ModelConfig
from tfpar.model.lm import build_model
from tfpar.parallel.registry import build_strategy
from tfpar.objective.step import make_train_step
import keras

dist = DistConfig(strategy="tower", cpu_devices=3, devices=("/cpu:0", "/cpu:1"),
                  variable_device="/cpu:2", log_device_placement=True)
prepare_runtime(dist)
plugin = build_strategy(dist)
with plugin.scope():
    model = build_model(ModelConfig(embed_dim=4, hidden_dim=4, layers=1, dropout=0.0,
                                    tie_embeddings=False, init_scale=0.0), 10)
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
batch = {"inputs": tf.constant([[2, 5, 6], [2, 7, 0], [2, 8, 9]]),
         "targets": tf.constant([[5, 6, 2], [7, 2, 0], [8, 9, 2]])}
make_train_step(plugin, model, optimizer, clip_norm=1.0)(batch)
"""


VARIABLE_HANDLE_OPS = {"ReadVariableOp", "VariableShape", "Enter", "Const"}


def test_log_device_placement_shows_where_tower_ops_ran(tmp_path):
    """--log-device-placement (via the CLI's prepare_runtime) prints TF's placer log; it
    shows where ops actually ran: tower 1's forward and gradient ops on /cpu:1, its reads
    of the weights and the optimizer's updates on the variable device /cpu:2."""
    script = tmp_path / "placement.py"
    script.write_text(PLACEMENT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)),
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    placed = {}  # op name -> (op type, device), from lines "name: (Type): /job:.../device:X:N"
    for line in proc.stdout.splitlines():
        m = re.match(r"^(\S+): \((\w+)\): /job:localhost/replica:0/task:0/device:(CPU:\d)$",
                     line)
        if m:
            placed[m.group(1)] = (m.group(2), m.group(3))
    forward = {n: v for n, v in placed.items() if n.startswith("tower_1/")}
    backward = {n: v for n, v in placed.items() if n.startswith("gradient_tape/tower_1/")}
    for ops in (forward, backward):
        # Every computing op on the tower; the ops that touch a weight's resource handle
        # (reads, shape queries, entering it into the RNN loop) go where the weight lives.
        computing = {n: d for n, (t, d) in ops.items() if t not in VARIABLE_HANDLE_OPS}
        # (The batch has a fixed shape, so the recurrence and the loss run as XLA launches,
        # a few ops each: ~50 computing ops a direction, not hundreds.)
        assert len(computing) > 30 and set(computing.values()) == {"CPU:1"}
        assert "MatMul" in {t for t, _ in ops.values()}
        assert {d for t, d in ops.values() if t in ("ReadVariableOp", "VariableShape")} <= {
            "CPU:2"}
    assert any(t == "ReadVariableOp" for t, _ in forward.values())
    updates = [v for v in placed.values() if v[0] == "AssignSubVariableOp"]
    assert len(updates) == 6 and {d for _, d in updates} == {"CPU:2"}


def test_non_finite_gradient_leaves_the_weights_alone():
    """--on-nan relies on the step: an inf/NaN gradient must not reach the weights."""
    plugin, model, step = fresh(DistConfig(strategy="tower", devices=tuple(CPU[:2])))
    bias = model.get_layer("softmax").bias
    bias.assign(np.full(bias.shape, np.nan, np.float32))
    before = [w.copy() for w in model.get_weights()]
    out = step(batch_of([[5, 6, 7, 2], [8, 9, 2, 0]]))
    assert not np.isfinite(float(out.grad_norm))
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_default_variable_device():
    """The first tower's, GPU towers included (the weights stay on the GPUs); "cpu"
    asks for TF1's host placement."""
    assert default_variable_device(["/device:GPU:0", "/device:GPU:1"]) == "/device:GPU:0"
    assert default_variable_device(["/device:CPU:1", "/device:CPU:2"]) == "/device:CPU:1"
    from tfpar.parallel.tower import build_tower

    plugin = build_tower(DistConfig(strategy="tower", devices=("/cpu:1", "/cpu:2"),
                                    variable_device="cpu"))
    assert plugin.variable_device == "/device:CPU:0"
    plugin = build_strategy(DistConfig(strategy="tower", cpu_devices=3))
    assert plugin.devices == CPU[:3] and plugin.variable_device == CPU[0]
    assert plugin.num_replicas == 3


@pytest.mark.parametrize("field,value,match", [
    ("devices", ("/cpu:0", "/gpu:63"), r"device '/gpu:63' does not exist on this host; available"),
    ("variable_device", "/gpu:3", r"device '/gpu:3' does not exist on this host"),
    ("variable_device", "cpu-zero", r"cannot parse device name 'cpu-zero'"),
])
def test_missing_devices_raise_one_line_device_error(field, value, match):
    with pytest.raises(DeviceError, match=match) as err:
        build_strategy(DistConfig(strategy="tower", **{field: value}))
    assert "\n" not in str(err.value)


@pytest.fixture
def soft_placement():
    before = tf.config.get_soft_device_placement()
    yield tf.config.set_soft_device_placement
    tf.config.set_soft_device_placement(before)


def test_soft_placement_lets_a_tower_fall_back(soft_placement):
    """A tower on a device TF cannot serve (no host has GPU 63) fails without soft placement, and
    falls back with it (TF1's allow_soft_placement), computing the same result."""
    batch = batch_of([[5, 6, 7, 2], [8, 9, 2, 0]])
    ref_plugin, ref_model, _ = fresh(DistConfig())
    ref = make_eval_step(ref_plugin, ref_model)(batch)
    plugin = TowerPlugin(["/device:GPU:63", CPU[1]], CPU[0], "controller")
    _, model, _ = fresh(plugin)

    soft_placement(False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="GPU:63"):
        make_eval_step(plugin, model)(batch)
    soft_placement(True)
    out = make_eval_step(plugin, model)(batch)
    assert float(out.nll_sum) == pytest.approx(float(ref.nll_sum), rel=1e-6)


# ----------------------------------------------------------------- learning-rate scaling
def test_linear_scaling_multiplies_by_towers_and_warmup_ramps():
    towers = build_strategy(DistConfig(strategy="tower", cpu_devices=3)).num_replicas
    linear = small_config(train=train_config(lr=0.1, scale_lr="linear", warmup_steps=4))
    assert base_learning_rate(linear.train, towers) == pytest.approx(0.3)
    assert base_learning_rate(train_config(lr=0.1), towers) == pytest.approx(0.1)
    schedule = EpochSchedule(0.3, 1.0, 0, 4, tf.Variable(0, dtype=tf.int64))
    lrs = [float(schedule(step)) for step in range(6)]
    np.testing.assert_allclose(lrs, [0.075, 0.15, 0.225, 0.3, 0.3, 0.3], rtol=1e-6)
    help_text = cli.train_parser().format_help()
    assert "--scale-lr" in help_text and "replica count" in help_text


# ----------------------------------------------------------------- end to end
@pytest.mark.parametrize("extra", [["--mode", "stream", "--bptt", "8",
                                    "--tower-reduce", "ring"]])
def test_train_main_tower_trains_and_exports(tiny_args, tmp_path, extra):
    """The whole command under tower:3 (stream mode, the ring): its metrics and export.
    (Sentence mode under tower: the equivalence tests above.)"""
    assert cli.train_main(tiny_args + ["--strategy", "tower", "--cpu-devices", "3"] + extra) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == "tower" and metrics["replicas"] == 3
    assert metrics["devices"] == CPU[:3]
    assert metrics["steps"] == 6
    assert np.isfinite(metrics["train_ppl"]) and np.isfinite(metrics["test_ppl"])
    assert os.path.exists(os.path.join(metrics["export_path"], "saved_model.pb"))


def test_train_main_tower_missing_device_is_a_one_line_error(tiny_args, capsys):
    assert cli.train_main(tiny_args + ["--strategy", "tower", "--devices", "/gpu:63"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: device '/gpu:63' does not exist on this host")
