"""--strategy parameter_server: partitioned variables with Keras 3 (gradients, updates,
checkpoints), one-line errors, and a real asynchronous cluster (chief + 2 workers + 2 ps)."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import (
    PINNED, REPO, model_config, small_config, train_config, write_sharded_corpus)
from tfpar.parallel.cluster.tf_config import parse_tf_config
from tfpar.objective import step as steps
from tfpar.objective.output import output_loss
from tfpar.training import summaries
from tfpar.tools.cli import train_main
from tfpar.config import DataConfig, RunConfig
from tfpar.errors import ConfigError
from tfpar.model.lm import build_model
from tfpar.parallel import parameter_server as ps

ShardedVariable = tf.__internal__.distribute.ShardedVariable


def split_in_two(next_creator, **kwargs):
    """A stand-in for ParameterServerStrategy with a TablePartitioner: every table of 2+
    rows (embedding, biases) becomes a ShardedVariable of two shards (no cluster needed)."""
    init = kwargs["initial_value"]
    value = tf.convert_to_tensor(init() if callable(init) else init, dtype=kwargs.get("dtype"))
    if value.shape.rank == 0 or ps.TablePartitioner(2, 1)(value.shape, value.dtype)[0] < 2:
        return next_creator(**kwargs)
    half = value.shape[0] // 2
    kwargs.pop("shape", None)
    parts = [next_creator(**dict(kwargs, initial_value=part, name=f"part_{i}"))
             for i, part in enumerate((value[:half], value[half:]))]
    return ShardedVariable(parts)


def sharded_scope():
    """Variables split in two, seen through the plug-in's creator (called first)."""
    stack = tf.variable_creator_scope(split_in_two)

    class Both:
        def __enter__(self):
            stack.__enter__()
            self.inner = tf.variable_creator_scope(ps._ps_variable_creator)
            self.inner.__enter__()

        def __exit__(self, *exc):
            self.inner.__exit__(*exc)
            stack.__exit__(*exc)

    return Both()


def test_tables_are_partitioned_and_matrices_are_not():
    partition = ps.TablePartitioner(max_shards=2)
    assert partition([50000, 128], tf.float32) == [2, 1]  # an embedding of 25 MB
    assert partition([256, 50000], tf.float32) == [1, 1]  # a softmax kernel: read whole
    assert partition([256, 1024], tf.float32) == [1, 1]  # a recurrent kernel
    assert partition([1000, 16], tf.float32) == [1, 1]  # 64 KB: below one 256 KiB shard
    assert partition([200000], tf.float32) == [2]


def test_a_sharded_keras_variable_checkpoints_like_an_unsharded_one(tmp_path):
    value = np.arange(12, dtype=np.float32).reshape(6, 2)
    with sharded_scope():
        sharded = keras.Variable(value)
    assert isinstance(sharded.value, ps.CheckpointedShards)
    assert [v.shape.as_list() for v in sharded.value.variables] == [[3, 2], [3, 2]]
    path = tf.train.Checkpoint(v=sharded).save(str(tmp_path / "ckpt"))
    sharded.assign(np.zeros_like(value))
    tf.train.Checkpoint(v=sharded).restore(path).assert_consumed()
    np.testing.assert_array_equal(sharded.numpy(), value)
    plain = keras.Variable(np.zeros_like(value))  # e.g. evaluate.py on one device
    tf.train.Checkpoint(v=plain).restore(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), value)


def test_sharded_gradients_and_updates_match_unsharded_ones(tmp_path):
    config = model_config(embed_dim=4, hidden_dim=4)
    plain = build_model(config, 12, seed=1)
    with sharded_scope():
        sharded = build_model(config, 12, seed=1)
        sharded.set_weights(plain.get_weights())
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.build(sharded.trainable_variables)
    assert sum(len(ps.shard_parts(v)) > 1 for v in sharded.trainable_variables) >= 3
    reference = keras.optimizers.Adam(0.1)
    reference.build(plain.trainable_variables)
    ids = tf.constant([[3, 4, 5, 0], [6, 7, 8, 9]], tf.int32)
    batch = {"inputs": ids, "targets": tf.roll(ids, -1, axis=1) * tf.cast(ids > 0, tf.int32)}
    count = tf.reduce_sum(tf.cast(batch["targets"] != 0, tf.float32))
    for _ in range(2):
        grads, nll, _ = ps.loss_and_grads(sharded, batch)
        want, want_nll, _, _ = steps.replica_gradients(plain, batch, count, loss=output_loss(plain.config))
        np.testing.assert_allclose(float(nll), float(want_nll), rtol=1e-6)
        for g, w in zip(grads, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-7)
        ps.apply_update(optimizer, grads, sharded.trainable_variables)
        reference.apply_gradients(zip(want, plain.trainable_variables))
    assert int(optimizer.iterations.numpy()) == 2
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    summaries.Writer(str(tmp_path), is_chief=True).histograms(sharded, step=2)  # no error


@pytest.mark.parametrize("config, message", [
    (small_config(data=DataConfig(mode="stream")), "--mode stream carries the RNN state"),
    (small_config(run=RunConfig(profile_steps=(2, 3))), "--profile-steps profiles steps in the "
                                                   "training process"),
    (small_config(train=train_config(weight_decay=0.01)), "--weight-decay 0.01: parameter_server "
                                                   "updates variables one by one"),
    (small_config(model=model_config(precision="mixed_float16")), "--precision mixed_float16: "
     "parameter_server updates variables one by one with the optimizer's update_step, which "
     "has no loss scaling; use --precision mixed_bfloat16"),
    (small_config(train=train_config(ema_momentum=0.99)), "--ema-momentum 0.99: "
     "parameter_server updates variables one by one with the optimizer's update_step, which "
     "keeps no moving average; use a synchronous strategy or --ema-momentum 0"),
    (small_config(train=train_config(steps_per_execution=4)), "--steps-per-execution 4: "
     "parameter_server schedules every step on a worker without waiting for it already; "
     "use --steps-per-execution 1"),
])
def test_settings_asynchronous_training_cannot_honour(config, message):
    from tfpar.parallel import registry

    with pytest.raises(ConfigError, match=message):
        ps.check_config(config)
    # The registry's check: refused before the coordinator is built (no cluster here).
    with pytest.raises(ConfigError, match=message):
        registry.build_for(config.replace(dist={"strategy": "parameter_server"}))


def ps_config(task_type="chief", index=0, ps_address="127.0.0.1:3", chief=True):
    jobs = {"worker": ["127.0.0.1:2"], "ps": [ps_address]}
    if chief:
        jobs["chief"] = ["127.0.0.1:1"]
    return json.dumps({"cluster": jobs, "task": {"type": task_type, "index": index}})


@pytest.mark.parametrize("tf_config, extra, message", [
    (ps_config(chief=False, task_type="worker"), [],
     "error: --strategy parameter_server needs a 'chief' task (the coordinator)"),
    (ps_config(task_type="ps", index=1), [], "error: TF_CONFIG task index 1 is out of range"),
    (ps_config(), ["--cpu-devices", "2"], "error: --cpu-devices 2: parameter_server runs each "
                                          "step on one worker's GPU or CPU"),
])
def test_cluster_errors_are_one_line(tf_config, extra, message, tiny_args, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    assert train_main(tiny_args + ["--strategy", "parameter_server"] + extra) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(message)


def test_a_ps_task_whose_port_is_taken_does_not_serve(tiny_args, monkeypatch, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setenv("TF_CONFIG", ps_config("ps", 0, ps_address=address))
        assert train_main(tiny_args + ["--strategy", "parameter_server"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: port {address.split(':')[1]} of this task's address {address} is already in "
        "use; stop the process holding it or give this task another port")


# ----------------------------------------------------------------------------- processes
def evaluate_checkpoint(model_dir, capsys) -> float:
    """The valid perplexity of the run's last checkpoint, restored on one device."""
    spec = importlib.util.spec_from_file_location("evaluate_script",
                                                  os.path.join(REPO, "scripts", "evaluate.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    assert script.main(["--model-dir", str(model_dir), "--split", "valid", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["perplexity"]


@pytest.mark.cluster
def test_asynchronous_training_on_a_local_cluster(tmp_path, capsys):
    """chief + 2 workers + 2 ps as real processes, trained from a folder of 4 train shards
    (each worker reads its own 2); the embedding (1541 x 128 floats) is large enough to be
    partitioned over both ps tasks."""
    steps_ = 120
    shards = write_sharded_corpus(tmp_path / "corpus", (1000, 100, 100))
    args = ["--strategy", "parameter_server", *PINNED, "--max-steps", str(steps_), "--epochs", "3",
            "--data", str(shards), "--embed-dim", "128", "--hidden-dim", "16",
            "--batch-size", "16", "--lr", "0.02", "--checkpoint-every", "40", "--no-progress",
            "--eval-batch-size", "100", "--model-dir", str(tmp_path / "run"),
            "--export-dir", str(tmp_path / "export"), "--metrics-json", str(tmp_path / "m.json")]
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "launch_local.py"), "--workers", "2",
         "--ps", "2", "--", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout
    assert "partitioned: rnn_lm/embedding/embeddings" in log
    assert "input: each of the 2 workers reads its own 2 of the 4 train files" in log
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["strategy"], m["workers"], m["steps"]) == ("parameter_server", 2, steps_)
    assert m["valid_ppl"] < m["unigram_valid_ppl"]  # it learned more than word frequencies
    assert os.path.exists(os.path.join(m["export_path"], "saved_model.pb"))
    # The coordinator evaluated its copy of the final parameters; the checkpoint restored
    # on one device (one partitioned variable saved whole) gives the same perplexity.
    assert evaluate_checkpoint(tmp_path / "run", capsys) == pytest.approx(m["valid_ppl"], rel=1e-5)


def test_sampled_softmax_gradients_stay_sparse_across_shards_and_update_like_unsharded():
    """--softmax sampled on partitioned tables: each shard's tf.IndexedSlices are joined
    with their rows moved by the shard's offset, and an SGD update scatters into the
    shards exactly what the unsharded model's does."""
    config = model_config(embed_dim=4, hidden_dim=4, softmax="sampled", num_sampled=4)
    plain = build_model(config, 12, seed=1)
    with sharded_scope():
        sharded = build_model(config, 12, seed=1)
        sharded.set_weights(plain.get_weights())
        optimizer = keras.optimizers.SGD(0.5)
        optimizer.build(sharded.trainable_variables)
    sharded_paths = {v.path for v in sharded.trainable_variables if len(ps.shard_parts(v)) > 1}
    tables = {"rnn_lm/embedding/embeddings", "rnn_lm/softmax/kernel", "rnn_lm/softmax/bias"}
    assert tables <= sharded_paths
    reference = keras.optimizers.SGD(0.5)
    ids = tf.constant([[3, 4, 5, 0], [6, 7, 8, 9]], tf.int32)
    batch = {"inputs": ids, "targets": tf.roll(ids, -1, axis=1) * tf.cast(ids > 0, tf.int32)}
    count = tf.reduce_sum(tf.cast(batch["targets"] != 0, tf.float32))
    grads, nll, _ = ps.loss_and_grads(sharded, batch)
    want, want_nll, _, _ = steps.replica_gradients(plain, batch, count, loss=output_loss(plain.config))
    np.testing.assert_allclose(float(nll), float(want_nll), rtol=1e-6)
    for v, g, w in zip(sharded.trainable_variables, grads, want):
        assert isinstance(g, tf.IndexedSlices) == (v.path in tables), v.path
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(),
                                   tf.convert_to_tensor(w).numpy(), rtol=1e-5, atol=1e-7)
    ps.apply_update(optimizer, grads, sharded.trainable_variables)
    reference.apply_gradients(zip(want, plain.trainable_variables))
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
