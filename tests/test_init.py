"""Initial weights (tfpar.model.init): every weight its own stream, the same values under
every strategy, and the LSTM's forget-gate bias as --forget-bias sets it."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO
from tfpar.config import DistConfig, ModelConfig
from tfpar.errors import ConfigError
from tfpar.model.init import ForgetGateBias, role_seed
from tfpar.model.lm import build_model
from tfpar.parallel.registry import build_strategy
from tfpar.training.state import build_train_state

VOCAB = 67
LEADING = 16


def random_weights(model) -> dict[str, np.ndarray]:
    """Every randomly initialised weight (biases start from constants)."""
    return {v.path: v.numpy() for v in model.weights if not v.path.endswith("bias")}


@pytest.mark.parametrize("fields", [
    dict(tie_embeddings=False),
    dict(tie_embeddings=True, embed_dim=24, hidden_dim=32),  # with the tied projection
    dict(cell="gru", tie_embeddings=False),
    dict(cell="gru", tie_embeddings=True),
    dict(softmax="sampled", num_sampled=8, tie_embeddings=False),
    dict(tie_embeddings=False, init_scale=0.0),  # Keras' kinds of initializer, seeded
], ids=["lstm", "lstm-tied-projected", "gru", "gru-tied", "sampled", "keras-defaults"])
def test_no_two_weights_start_from_the_same_numbers(fields):
    """One shared integer-seeded initializer gave every [200, 800] LSTM matrix the same
    values, and the embedding and the softmax kernel the same leading values. Leading
    values that are merely proportional (one stream at two scales) count as the same."""
    fields = {"embed_dim": 32, "hidden_dim": 32, **fields}
    weights = random_weights(build_model(ModelConfig(**fields), VOCAB, seed=3))
    assert len(weights) >= 5
    for (a, wa), (b, wb) in itertools.combinations(weights.items(), 2):
        lead_a, lead_b = wa.ravel()[:LEADING], wb.ravel()[:LEADING]
        correlation = abs(np.corrcoef(lead_a, lead_b)[0, 1])
        assert correlation < 0.9, f"{a} and {b} begin with the same numbers: {lead_a[:3]}"


def test_initial_weights_repeat_for_a_seed_and_change_with_it():
    config = ModelConfig(embed_dim=16, hidden_dim=16)
    first, again = (random_weights(build_model(config, VOCAB, seed=7)) for _ in range(2))
    other = random_weights(build_model(config, VOCAB, seed=8))
    for path in first:
        np.testing.assert_array_equal(first[path], again[path])
        assert not np.array_equal(first[path], other[path]), path
    assert role_seed(7, "rnn_0/kernel") != role_seed(7, "rnn_1/kernel")
    assert role_seed(7, "rnn_0/kernel") != role_seed(8, "rnn_0/kernel")


@pytest.mark.parametrize("forget_bias", [0.0, 1.0, -0.5])
def test_the_lstm_bias_starts_at_zero_but_for_the_forget_gate(forget_bias):
    model = build_model(ModelConfig(embed_dim=8, hidden_dim=6, forget_bias=forget_bias),
                        VOCAB)
    for rnn in model.rnns:
        bias = rnn.cell.bias.numpy()  # Keras' gate order: input, forget, cell, output
        np.testing.assert_array_equal(bias[6:12], np.full(6, forget_bias, np.float32))
        np.testing.assert_array_equal(np.delete(bias, np.s_[6:12]), np.zeros(18))


def test_forget_bias_defaults_for_an_lstm_and_is_refused_for_a_gru():
    assert ModelConfig().initial_forget_bias == 0.0
    assert ModelConfig(forget_bias=1.0).initial_forget_bias == 1.0
    with pytest.raises(ConfigError, match=r"^forget-bias 1.0 applies to the LSTM's forget "
                       r"gate; --cell gru has none: drop --forget-bias$"):
        ModelConfig(cell="gru", forget_bias=1.0)
    assert ForgetGateBias.from_config(ForgetGateBias(0.5).get_config()).value == 0.5


# The model every strategy builds: its embedding (2,100 x 128 floats, 1 MB) is large
# enough for parameter_server's partitioner to split it over two ps tasks.
SHARED = dict(embed_dim=128, hidden_dim=32, tie_embeddings=True)
SHARED_VOCAB, SHARED_SEED = 2100, 5


def reference_weights() -> list[np.ndarray]:
    return [w.numpy() for w in build_model(ModelConfig(**SHARED), SHARED_VOCAB,
                                           seed=SHARED_SEED).weights]


@pytest.mark.parametrize("dist", [
    DistConfig(strategy="mirrored", devices=("/cpu:0", "/cpu:1")),
    DistConfig(strategy="pipeline", stages="embedding=/cpu:0,rnn_0=/cpu:0,rnn_1=/cpu:1,softmax=/cpu:1"),
], ids=["mirrored:2", "pipeline:2"])
def test_every_strategy_builds_the_same_initial_weights(dist):
    """verify copies one weight set to every strategy, so it cannot show this: each
    strategy's own variable creation (mirrored copies, stage placement) must draw the
    values one device draws."""
    plugin = build_strategy(dist)
    state = build_train_state(plugin.scope(), ModelConfig(**SHARED), SHARED_VOCAB,
                              seed=SHARED_SEED)
    for got, want in zip([w.numpy() for w in state.model.weights], reference_weights(),
                         strict=True):
        np.testing.assert_array_equal(got, want)


PS_BUILD = """
import socket, sys
import numpy as np
import tensorflow as tf
from tfpar.config import ModelConfig
from tfpar.model.lm import build_model
from tfpar.parallel import parameter_server as ps

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    return p

spec = {"worker": [f"127.0.0.1:{port()}"], "chief": [f"127.0.0.1:{port()}"],
        "ps": [f"127.0.0.1:{port()}", f"127.0.0.1:{port()}"]}
cluster = tf.train.ClusterSpec(spec)
servers = [tf.distribute.Server(cluster, job_name=job, task_index=i, start=True)
           for job in ("worker", "ps") for i in range(len(spec[job]))]
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    cluster, task_type="chief", task_id=0, rpc_layer="grpc")
strategy = tf.distribute.ParameterServerStrategy(
    resolver, variable_partitioner=ps.TablePartitioner(max_shards=2))
with strategy.scope(), tf.variable_creator_scope(ps._ps_variable_creator):
    model = build_model(ModelConfig(**SHARED), VOCAB, seed=SEED)
assert len(ps.shard_parts(model.embedding.embeddings)) == 2, "the embedding is not sharded"
np.savez(sys.argv[1], *[v.numpy() for v in model.weights])
"""


def test_parameter_server_builds_the_same_initial_weights(tmp_path):
    """Under ParameterServerStrategy with its partitioner (an in-process cluster of a
    chief, a worker and two ps tasks, in its own process): the embedding is split over
    the ps tasks, each shard initialised apart, and the whole equals one device's."""
    out = tmp_path / "weights.npz"
    code = (f"SHARED, VOCAB, SEED = {SHARED!r}, {SHARED_VOCAB}, {SHARED_SEED}\n" + PS_BUILD)
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, timeout=300)
    got = np.load(out)
    want = reference_weights()
    assert len(got.files) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[f"arr_{i}"], w)
