"""The pipeline strategy: equal to one device, placement and overlap on the traced graph,
--stages errors, CLI."""

import functools
import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import (
    PINNED, REPO, batch_of, make_lines, max_diff, model_config, slots_of)
from equivalence import assert_equivalent, make_setup, run_with_state
from tfpar.tools import cli
from tfpar.config import DataConfig, DistConfig
from tfpar.errors import ConfigError, DeviceError
from tfpar.data.pipeline import InputData
from tfpar.model.lm import build_model
from tfpar.parallel.registry import build_strategy, cpu_devices_needed
from tfpar.parallel.pipeline.plugin import PipelinePlugin
from tfpar.parallel.pipeline.stages import Placement, Stage, parse_stages, placement_from_config
from tfpar.tools.verify import run_plugin
from tfpar.data.vocab import Vocab
from tfpar.objective.step import make_eval_step, make_train_step

MODEL = model_config(embed_dim=16, hidden_dim=16, layers=2)
# The clip norm of the empty micro-batch tests below, under their first step's gradient
# norm (asserted). The runs compared with default use verify's automatic one (equivalence).
CLIP = 0.15
BATCH = 10  # 10 rows: 3 micro-batches get 4/3/3 rows.
CPU = [f"/device:CPU:{i}" for i in range(4)]
TWO = "embedding=/cpu:0,rnn=/cpu:1,softmax=/cpu:1"
THREE = "embedding=/cpu:0,rnn_0=/cpu:1,rnn_1=/cpu:2,softmax=/cpu:2"


def setup(mode="sentence", model=MODEL):
    """The set-up of one mode (cached whichever way it is called)."""
    return cached_setup(mode, model)


@functools.lru_cache(maxsize=None)
def cached_setup(mode, model):
    """Data, initial weights and run settings shared by every run of one mode: STEPS
    steps, the median of the first steps' gradient norms as the clip norm (so some steps
    are clipped and some not, asserted: on a clipped step a gradient off by a constant
    factor gives the very same update, so only the unclipped ones (and the norms) can
    tell a wrong gradient from a right one)."""
    lines = make_lines(160)
    data = InputData({"train": lines, "valid": make_lines(30, seed=1), "test": lines[:5]},
                     Vocab.build(lines), DataConfig(mode=mode, bptt=6, max_length=20), seed=1)
    return make_setup(data, model, mode, batch_size=BATCH)


@functools.lru_cache(maxsize=None)
def run(stages="", micro_batches=1, mode="sentence", model=MODEL):
    """Trains STEPS SGD steps from the shared initial weights (cached: runs are reused);
    returns the result and the state carried out of the last window (stream mode)."""
    dist = DistConfig()
    if stages:
        dist = DistConfig(strategy="pipeline", stages=stages, micro_batches=micro_batches)
    return run_with_state(run_plugin, setup(mode, model), dist)


# ----------------------------------------------------------------- equal to one device
# Every M with 2 and 3 devices, in both modes, without the whole product (each run traces
# S x M LSTM pieces and their gradients; the product took minutes on 2 cores).
@pytest.mark.parametrize("micro_batches,stages,mode", [
    (1, TWO, "sentence"), (2, THREE, "sentence"), (3, TWO, "sentence"), (3, THREE, "sentence"),
    (1, THREE, "stream"), (2, TWO, "stream"), (3, THREE, "stream"),
], ids=["M1-2dev-sentence", "M2-3dev-sentence", "M3-2dev-sentence", "M3-3dev-sentence",
        "M1-3dev-stream", "M2-2dev-stream", "M3-3dev-stream"])
def test_pipeline_matches_default_with_clipping(micro_batches, stages, mode):
    """Norms, weights, slots, eval and, in stream mode, the state of both layers carried
    out of the last window (each layer's rows joined from the micro-batches)."""
    assert_equivalent(run(stages, micro_batches, mode), run(mode=mode), setup(mode))


def test_tied_embedding_split_from_its_softmax_matches_default():
    """The tied matrix gets gradient from two stages on two devices; summed on its own."""
    tied = model_config(embed_dim=16, hidden_dim=16, layers=1, tie_embeddings=True)
    ref = run(model=tied)
    got = run("embedding=/cpu:0,rnn_0=/cpu:1,softmax=/cpu:2", 2, model=tied)
    assert len(ref.result.weights) == 5  # One matrix for the embedding and the softmax.
    assert_equivalent(got, ref, setup(model=tied))


# ----------------------------------------------------------------- empty micro-batches
def build(dist, model_config=MODEL, momentum=0.0):
    plugin = build_strategy(dist)
    with plugin.scope():
        model = build_model(model_config, len(setup().data.vocab), seed=0)
        model.set_weights(setup().initial_weights)
        optimizer = keras.optimizers.SGD(0.5, momentum=momentum)
        optimizer.build(model.trainable_variables)
    return plugin, model, optimizer


def fresh(dist, clip=CLIP, model_config=MODEL):
    plugin, model, optimizer = build(dist, model_config)
    return plugin, model, make_train_step(plugin, model, optimizer, clip_norm=clip)


def clipped_and_unclipped_steps(dist):
    """SGD-momentum train steps of one model: clipped to CLIP, and with no clipping (0)."""
    plugin, model, optimizer = build(dist, momentum=0.5)
    steps = [make_train_step(plugin, model, optimizer, clip_norm=clip) for clip in (CLIP, 0.0)]
    return plugin, model, optimizer, steps


@pytest.mark.parametrize("name,rows,micro_batches", [
    # Fewer rows than micro-batches: micro-batches 2 and 3 get no rows at all.
    ("fewer rows than micro-batches", [[5, 6, 7, 2], [8, 9, 2, 0]], 4),
    # Micro-batch 1 (the last two rows of four) holds only padding.
    ("a micro-batch of padding", [[5, 6, 7, 2], [8, 9, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]], 2),
])
def test_empty_micro_batches_give_the_default_update(name, rows, micro_batches):
    batch = batch_of(rows)
    _, ref_model, ref_optimizer, ref_steps = clipped_and_unclipped_steps(DistConfig())
    _, model, optimizer, steps = clipped_and_unclipped_steps(
        DistConfig(strategy="pipeline", stages=TWO, micro_batches=micro_batches))
    for k in range(2):  # A clipped step, then an unclipped one from where it left off.
        ref_out, out = ref_steps[k](batch), steps[k](batch)
        assert np.isfinite(float(out.grad_norm))
        assert k or float(ref_out.grad_norm) > CLIP  # Step 0 is clipped (step 1: clip 0).
        assert float(out.count) == float(ref_out.count) == float((np.array(rows) != 0).sum())
        assert float(out.nll_sum) == pytest.approx(float(ref_out.nll_sum), rel=1e-6)
        assert float(out.grad_norm) == pytest.approx(float(ref_out.grad_norm), rel=1e-5)
    assert max_diff(model.get_weights(), ref_model.get_weights()) <= 1e-6
    slots = slots_of(optimizer)
    assert len(slots) == len(model.trainable_variables) + 2
    assert max_diff(slots, slots_of(ref_optimizer)) <= 1e-6


def test_stream_state_with_empty_micro_batches_keeps_the_global_rows():
    """Stream eval and train with 3 rows in 4 micro-batches: the state comes back as
    [3, H] per tensor and equals one device's, window after window; training (a clipped
    window, then an unclipped one) leaves the same weights and momentum slots."""
    batch = batch_of([[5, 6, 7], [8, 9, 2], [4, 4, 4]])
    plugin, model, optimizer, steps = clipped_and_unclipped_steps(
        DistConfig(strategy="pipeline", stages=TWO, micro_batches=4))
    ref_plugin, ref_model, ref_optimizer, ref_steps = clipped_and_unclipped_steps(DistConfig())
    evals = (make_eval_step(plugin, model), make_eval_step(ref_plugin, ref_model))
    norms = []
    for pairs in ([evals] * 2, list(zip(steps, ref_steps))):
        state = ref_state = None
        for fns in pairs:  # The second window starts from the carried state.
            out, ref = fns[0](batch, state), fns[1](batch, ref_state)
            state, ref_state = out.state, ref.state
            assert float(out.nll_sum) == pytest.approx(float(ref.nll_sum), rel=1e-6)
            assert len(state) == MODEL.layers
            for s, r in zip(tf.nest.flatten(state), tf.nest.flatten(ref_state)):
                assert s.shape == (3, MODEL.hidden_dim)
                np.testing.assert_allclose(s.numpy(), r.numpy(), atol=1e-6)
            if out.grad_norm is not None:  # Training: window 1 clipped, window 2 not.
                assert float(out.grad_norm) == pytest.approx(float(ref.grad_norm), rel=1e-5)
                norms.append(float(ref.grad_norm))
    assert norms[0] > CLIP  # The first window's step is clipped; the second has no clip.
    assert max_diff(model.get_weights(), ref_model.get_weights()) <= 1e-6
    assert max_diff(slots_of(optimizer), slots_of(ref_optimizer)) <= 1e-6


# ----------------------------------------------------------------- placement
SPEC = {"inputs": tf.TensorSpec([None, None], tf.int32),
        "targets": tf.TensorSpec([None, None], tf.int32)}
# Ops without a requested device: reads of the variables (TF puts them with the variable)
# and constants the tracer folded.
UNPLACED = {"ReadVariableOp", "Placeholder", "Const"}
UPDATES = ("AssignSubVariableOp", "AssignAddVariableOp", "AssignVariableOp")


def stage_of(op_name):
    """The stage whose scope an op is under (its gradient ops too), or None."""
    for prefix in ("", "gradient_tape/"):
        for k in range(4):
            if op_name.startswith(f"{prefix}stage_{k}/"):
                return k
    return None


def placed(ops):
    return [op for op in ops if not (op.type in UNPLACED and not op.device)]


@functools.lru_cache(maxsize=None)
def traced(stages=THREE, micro_batches=3):
    plugin, model, step = fresh(DistConfig(strategy="pipeline", stages=stages,
                                           micro_batches=micro_batches))
    graph = step.function.get_concrete_function(SPEC).graph
    return plugin, model, graph


def test_weights_live_on_their_stage_device():
    plugin, model, _ = traced()
    expected = {"embedding": CPU[0], "rnn_0": CPU[1], "rnn_1": CPU[2], "softmax": CPU[2]}
    assert [(s.device, s.parts) for s in plugin.stages] == [
        (CPU[0], ("embedding",)), (CPU[1], ("rnn_0",)), (CPU[2], ("rnn_1", "softmax"))]
    assert plugin.devices == CPU[:3]
    for v in model.trainable_variables:
        part = v.path.split("/")[1]
        assert v.value.device.endswith(expected[part].split("device:")[1]), v.path


def nested_graphs(graph, op):
    """The bodies of the functions ``op`` calls (loops, XLA-compiled recurrences)."""
    for attr in op.node_def.attr.values():
        for name in [attr.func.name] + [f.name for f in attr.list.func]:
            if name:
                body = graph._get_function(name).graph
                yield body
                for inner in body.get_operations():
                    yield from nested_graphs(body, inner)


def test_traced_step_places_every_stage_op_on_its_device_gradients_included():
    plugin, model, graph = traced()
    ops = graph.get_operations()
    per_stage = {k: [] for k in range(3)}
    for op in placed(ops):
        k = stage_of(op.name)
        if k is not None:
            per_stage[k].append(op)
    for k, stage_ops in per_stage.items():
        device = plugin.stages[k].device
        assert {op.device for op in stage_ops} == {device}, k
        for j in range(3):  # Every micro-batch, forward and backward, on every stage.
            forward = [op for op in stage_ops if op.name.startswith(f"stage_{k}/forward_mb_{j}/")]
            gradient = [op for op in stage_ops
                        if op.name.startswith(f"gradient_tape/stage_{k}/forward_mb_{j}/")]
            assert len(forward) > 5 and len(gradient) > 5, (k, j)
        # Ops inside called functions (the RNN's loops) run on the caller's device: they
        # name no other one.
        bodies = [body for op in stage_ops for body in nested_graphs(graph, op)]
        assert bool(bodies) == any(p.startswith("rnn_") for p in plugin.stages[k].parts)
        for body in bodies:
            assert {o.device for o in placed(body.get_operations())} <= {"", device}
    # The optimizer's updates request no device: TF runs an op on a resource where the
    # resource lives, so each weight is updated on its stage's device. They sit in the
    # finite guard's branch (tfpar.objective.step.update), whose inputs are the guard's.
    handles = {internal.name: external for external, internal in graph.captures}
    guards = [op for op in ops if op.type == "If" and op.name.split("/")[0] == "cond"]
    updates, updated = [], set()
    for guard in guards:
        branch = guard.get_attr("then_branch").name
        body = graph._get_function(branch).graph
        for op in body.get_operations():
            if op.type in UPDATES:
                updates.append(op)
                names = [t.name for t in body.inputs]
                outer = guard.inputs[1 + names.index(op.inputs[0].name)]
                if op.device == "" and outer.name in handles:
                    updated.add(handles[outer.name].device)
    assert len(guards) == 1
    assert len(updates) >= len(model.trainable_variables)
    assert {op.device for op in updates} == {""}
    assert {d.split("device:")[1] for d in updated} >= {d.split("device:")[1] for d in CPU[:3]}


PLACEMENT_LINE = re.compile(r"^(\S+): \(\w+\): /job:\S+/(device:\w+:\d+)$", re.MULTILINE)


def test_placement_log_shows_every_stage_op_on_its_device(tiny_corpus_dir, tmp_path):
    """What the runtime did, not what the graph asked for: the --log-device-placement
    output of scripts/train.py (inlined loop bodies included). TensorFlow reads that
    option only when it starts, hence a fresh process. (It caught a recurrence fed from a
    device-less variable read: its loop plumbing ran on /cpu:0 for stage 1.)"""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "train.py"), "--data",
         str(tiny_corpus_dir), *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
         "--layers", "2",
         "--batch-size", "8", "--max-steps", "1", "--epochs", "1", "--no-progress",
         "--no-export", "--model-dir", str(tmp_path / "run"), "--strategy", "pipeline",
         "--micro-batches", "2", "--log-device-placement"],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    per_stage = {0: {}, 1: {}}
    for m in PLACEMENT_LINE.finditer(proc.stdout + proc.stderr):  # printf: stdout
        k = stage_of(m.group(1).removeprefix("Func/"))
        if k is not None:
            per_stage[k][m.group(1)] = "/" + m.group(2)
    for k, device in enumerate(CPU[:2]):  # The default split: embedding, rnn_0 | rnn_1, softmax
        assert len(per_stage[k]) > 100
        wrong = sorted(name for name, placed_on in per_stage[k].items() if placed_on != device)
        assert not wrong, f"{len(wrong)} ops of stage {k} elsewhere, e.g. {wrong[:3]}"


def ancestors(ops):
    """Names of every op ``ops`` depend on, through data and control edges (captured
    weights enter as placeholders named after their first use: not a dependency)."""
    seen, todo = set(), list(ops)
    while todo:
        cur = todo.pop()
        for parent in [t.op for t in cur.inputs] + list(cur.control_inputs):
            if parent.name not in seen and parent.type != "Placeholder":
                seen.add(parent.name)
                todo.append(parent)
    return seen


def micro_batch_of(name):
    return int(name.split("/forward_mb_")[1].split("/")[0])


def test_micro_batches_are_not_serialised_on_a_stage():
    """Stage k can run micro-batch j+1 while stage k+1 runs j: in the traced graph no
    forward op of micro-batch j+1 waits for any op of micro-batch j (and no forward op
    waits for a backward one), so only the data flow orders the pieces."""
    _, _, graph = traced()
    ops = graph.get_operations()
    for k in range(3):
        for j in range(3):
            piece = [op for op in ops if op.name.startswith(f"stage_{k}/forward_mb_{j}/")]
            before = ancestors(piece)
            assert not [n for n in before if "backward_mb_" in n or "gradient_tape/" in n]
            assert {micro_batch_of(n) for n in before if "/forward_mb_" in n} <= {j}
            # ... and it does wait for the stage before it on the same micro-batch.
            if k:
                assert any(n.startswith(f"stage_{k - 1}/forward_mb_{j}/") for n in before)
            # Its backward waits for nothing of another micro-batch either.
            backward = [op for op in ops if op.name.startswith(
                (f"gradient_tape/stage_{k}/forward_mb_{j}/", f"stage_{k}/backward_mb_{j}/"))]
            assert backward
            assert not [n for n in ancestors(backward) if "mb_" in n and f"mb_{j}/" not in n]


# ----------------------------------------------------------------- stages and errors
def test_default_stages_split_the_model_over_two_cpus():
    plugin = build_strategy(DistConfig(strategy="pipeline"))
    assert plugin.num_replicas == 1
    assert plugin.placement.stages(2) == [
        Stage(0, CPU[0], ("embedding", "rnn_0")), Stage(1, CPU[1], ("rnn_1", "softmax"))]
    assert plugin.placement.stages(1) == [
        Stage(0, CPU[0], ("embedding", "rnn_0")), Stage(1, CPU[1], ("softmax",))]
    three = placement_from_config(DistConfig(strategy="pipeline", cpu_devices=3))
    assert three.stages(3) == [Stage(0, CPU[0], ("embedding", "rnn_0")),
                               Stage(1, CPU[1], ("rnn_1",)),
                               Stage(2, CPU[2], ("rnn_2", "softmax"))]
    # With accelerators: the embedding on the host CPU, the rest on the GPUs.
    gpus = Placement(compute=["/device:GPU:0", "/device:GPU:1"], host=CPU[0])
    assert gpus.stages(3) == [Stage(0, CPU[0], ("embedding",)),
                              Stage(1, "/device:GPU:0", ("rnn_0",)),
                              Stage(2, "/device:GPU:1", ("rnn_1", "rnn_2", "softmax"))]
    one_gpu = Placement(compute=["/device:GPU:0"], host=CPU[0])
    assert [s.parts for s in one_gpu.stages(2)] == [("embedding",),
                                                    ("rnn_0", "rnn_1", "softmax")]


def test_a_tied_embedding_stays_with_the_softmax_on_accelerators():
    """The default rule with GPUs: a tied embedding is the softmax's matrix, so it goes on
    the softmax's GPU, not the host CPU; the plug-in is built knowing the tie (the model's
    config), before any variable is made. On CPUs the rule is unchanged."""
    gpus = ["/device:GPU:0", "/device:GPU:1"]
    plugin = PipelinePlugin(Placement(compute=gpus, host=CPU[0], tied=True), 2)
    assert plugin.placement.stages(2) == [Stage(0, gpus[1], ("embedding",)),
                                          Stage(1, gpus[0], ("rnn_0",)),
                                          Stage(2, gpus[1], ("rnn_1", "softmax"))]
    assert plugin.devices == gpus
    untied = PipelinePlugin(Placement(compute=gpus, host=CPU[0]), 2)
    assert untied.placement.device_of("embedding") == CPU[0]
    cpus = build_strategy(DistConfig(strategy="pipeline"), model_config(tie_embeddings=True))
    assert cpus.placement.tied
    assert cpus.placement.stages(2)[0] == Stage(0, CPU[0], ("embedding", "rnn_0"))
    # The builder passes the tie on; without a model config it places an untied one.
    assert not build_strategy(DistConfig(strategy="pipeline")).placement.tied


def test_stages_group_consecutive_parts_and_may_revisit_a_device():
    placement = placement_from_config(DistConfig(
        strategy="pipeline", stages="embedding=/cpu:0,rnn_0=/cpu:1,rnn_1=/cpu:0,softmax=cpu:1"))
    assert [(s.device, s.parts) for s in placement.stages(2)] == [
        (CPU[0], ("embedding",)), (CPU[1], ("rnn_0",)), (CPU[0], ("rnn_1",)),
        (CPU[1], ("softmax",))]


def test_parse_stages_accepts_rnn_for_every_layer():
    assert parse_stages(" Embedding=/cpu:0 , rnn=/cpu:1,softmax=/cpu:1,") == {
        "embedding": "/cpu:0", "rnn": "/cpu:1", "softmax": "/cpu:1"}


@pytest.mark.parametrize("stages,match", [
    ("embedding:/cpu:0,rnn=/cpu:1,softmax=/cpu:1",
     r"cannot parse --stages item 'embedding:/cpu:0'; expected PART=DEVICE"),
    ("embedding=,rnn=/cpu:1,softmax=/cpu:1", r"cannot parse --stages item 'embedding='"),
    ("embedding=/cpu:0,lstm=/cpu:1,softmax=/cpu:1",
     r"unknown part 'lstm' in --stages; the model's parts are embedding, rnn \(every RNN"),
    ("embedding=/cpu:0,rnn=/cpu:1,rnn_1=/cpu:0,softmax=/cpu:1",
     r"--stages assigns 'rnn_1' twice \('rnn' means every RNN layer\)"),
    ("embedding=/cpu:0,embedding=/cpu:1", r"--stages assigns 'embedding' twice"),
    (" , ", r"--stages ' , ' assigns no part"),
])
def test_malformed_stages_are_one_line_config_errors(stages, match):
    with pytest.raises(ConfigError, match=match) as err:
        build_strategy(DistConfig(strategy="pipeline", stages=stages))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("stages,match", [
    ("embedding=/cpu:0,rnn_0=/cpu:1",
     r"--stages leaves rnn_1, softmax unassigned; give every part a device"),
    ("embedding=/cpu:0,rnn_0=/cpu:1,rnn_1=/cpu:1,rnn_2=/cpu:1,softmax=/cpu:1",
     r"unknown part 'rnn_2' in --stages: this model has 2 RNN layer\(s\), rnn_0 ... rnn_1"),
])
def test_stages_that_do_not_fit_the_model_fail_before_training(stages, match):
    plugin = build_strategy(DistConfig(strategy="pipeline", stages=stages))
    with plugin.scope():
        model = build_model(MODEL, 20, seed=0)
    with pytest.raises(ConfigError, match=match) as err:
        make_train_step(plugin, model, keras.optimizers.SGD(0.1), clip_norm=1.0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dist,error,match", [
    (DistConfig(strategy="pipeline", stages="embedding=/cpu:0,rnn=/gpu:63,softmax=/cpu:1"),
     DeviceError, r"device '/gpu:63' does not exist on this host; available: /cpu:0"),
    (DistConfig(strategy="pipeline", stages="embedding=/cpu:0,rnn=/cpu:9,softmax=/cpu:1"),
     DeviceError, r"device '/cpu:9' does not exist on this host"),
    (DistConfig(strategy="pipeline", stages="embedding=cpu-zero,rnn=/cpu:1,softmax=/cpu:1"),
     DeviceError, r"cannot parse device name 'cpu-zero'"),
    (DistConfig(strategy="pipeline", stages=TWO, devices=("/cpu:0", "/cpu:1")),
     ConfigError, r"--devices /cpu:0,/cpu:1 and --stages both place the pipeline"),
    (DistConfig(strategy="pipeline", cpu_devices=9),
     DeviceError, r"9 devices were asked for"),
])
def test_missing_devices_are_one_line_errors(dist, error, match):
    with pytest.raises(error, match=match) as err:
        build_strategy(dist)
    assert "\n" not in str(err.value)


def test_cpu_devices_needed_counts_the_stage_devices():
    assert cpu_devices_needed(DistConfig(strategy="pipeline")) == 2
    assert cpu_devices_needed(DistConfig(strategy="pipeline", stages=THREE)) == 3
    assert cpu_devices_needed(DistConfig(
        strategy="pipeline", stages="embedding=/device:CPU:3,rnn=bad,softmax=/gpu:0")) == 4


# ----------------------------------------------------------------- end to end
@pytest.mark.parametrize("extra", [
    ["--mode", "stream", "--bptt", "8", "--stages",
     "embedding=/cpu:0,rnn=/cpu:1,softmax=/cpu:2"],
])
def test_train_main_pipeline_trains_evaluates_and_exports(tiny_args, tmp_path, extra):
    """The whole command under pipeline (stream mode, three stages): its metrics and
    export. (Sentence mode under the pipeline: test_pipeline_matches_default_with_clipping;
    the default two stages: test_default_stages_split_the_model_over_two_cpus.)"""
    assert cli.train_main(tiny_args + ["--strategy", "pipeline", "--micro-batches", "4"]
                          + extra) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == "pipeline" and metrics["replicas"] == 1
    assert metrics["devices"] == (CPU[:3] if extra else CPU[:2])
    assert metrics["steps"] == 6
    assert np.isfinite(metrics["train_ppl"]) and np.isfinite(metrics["test_ppl"])
    assert os.path.exists(os.path.join(metrics["export_path"], "saved_model.pb"))


def test_training_and_evaluation_place_a_tied_embedding_alike(tiny_args, tmp_path,
                                                              monkeypatch, capsys):
    """Placement is decided when the plug-in is built, for every command that builds one.
    The default rule with accelerators (the embedding on a host device, the rest on the
    compute devices; emulated here by CPU 0 as the host and CPU 1 as the one compute
    device) keeps a tied embedding with the softmax: training's start-up line, training's
    weights and ``tfpar-evaluate --model-dir``'s weights all put it on CPU 1."""
    from tfpar.parallel.pipeline import plugin as pipeline_plugin
    from tfpar.tools import evaluate

    def accelerator_rule(dist, *args, **kwargs):
        # The rule's GPU form on two CPUs; ``tied`` as the builder passes it.
        return Placement(compute=[CPU[1]], host=CPU[0], *args, **kwargs)

    monkeypatch.setattr(pipeline_plugin, "placement_from_config", accelerator_rule)
    embedding_devices = []  # where each bound model's embedding lives (train, then eval)
    bind = PipelinePlugin.bind

    def recording_bind(self, model):
        embedding_devices.append(tf.DeviceSpec.from_string(
            model.embedding.trainable_variables[0].value.device).to_string())
        return bind(self, model)

    monkeypatch.setattr(PipelinePlugin, "bind", recording_bind)
    args = [a for a in tiny_args if a != "--no-tie-embeddings"]
    assert cli.train_main(args + ["--tie-embeddings", "--strategy", "pipeline",
                                  "--max-steps", "2", "--no-export"]) == 0
    log = capsys.readouterr().err
    assert re.search(r"strategy pipeline: embedding on /device:CPU:1, default split over "
                     r"/device:CPU:1", log), log
    trained = set(embedding_devices)
    assert trained == {"/job:localhost/replica:0/task:0/device:CPU:1"}, embedding_devices
    embedding_devices.clear()
    assert evaluate.main(["--model-dir", str(tmp_path / "run"), "--strategy", "pipeline",
                          "--json"]) == 0
    assert embedding_devices and set(embedding_devices) == trained


def test_train_main_bad_stages_is_a_one_line_error(tiny_args, capsys):
    assert cli.train_main(tiny_args + ["--strategy", "pipeline", "--stages",
                                       "embedding=/cpu:0,rnn=/cpu:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: --stages leaves softmax unassigned; give every part a device "
                       "(embedding, rnn (every RNN layer), rnn_0 ... rnn_{L-1}, softmax)")


def test_pipeline_plugin_without_a_model_has_no_stages():
    plugin = PipelinePlugin(Placement(compute=CPU[:2]), 2)
    assert plugin.devices == CPU[:2]
    with pytest.raises(RuntimeError, match="no model yet"):
        plugin.stages  # noqa: B018


# ----------------------------------------------------------------- benchmark
def test_pipeline_sweep_rows_and_measured_overlap():
    import bench_pipeline

    rows = bench_pipeline.pipeline_sweep(
        (1, 2), stages=TWO, batch_size=6, seq_len=4, vocab_size=30, embed_dim=8,
        hidden_dim=8, layers=1, steps=1, rounds=1)
    assert [r["micro_batches"] for r in rows] == [1, 2]
    assert [r["stages"] for r in rows] == [2, 2]
    assert [r["bubble_fraction_theory"] for r in rows] == [1 / 2, 1 / 3]
    assert rows[0]["speedup_vs_M1"] == 1.0
    for r in rows:
        assert r["step_seconds"] > 0 and r["one_device_step_seconds"] > 0
        assert r["overlap_speedup"] == pytest.approx(
            r["one_device_step_seconds"] / r["step_seconds"])
    # One micro-batch: no two stages ever work on different micro-batches at once.
    assert rows[0]["overlap_measured"] == 0.0
    assert 0.0 <= rows[1]["overlap_measured"] < 1.0
    table = bench_pipeline.format_table(rows)
    assert table.splitlines()[0].split()[:2] == ["M", "step"]
    assert len(table.splitlines()) == 4


def test_bench_main_rejects_bad_micro_batches(capsys):
    import bench_pipeline

    assert bench_pipeline.main(["--micro-batches", "1,two"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --micro-batches '1,two' must be comma-separated integers, e.g. 1,2,4,8")
