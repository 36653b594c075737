"""FastLSTM / FastGRU must compute exactly what Keras' LSTM / GRU compute."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import model_config
from tfpar.model.layers import FastGRU, FastLSTM

PAIRS = [(FastLSTM, keras.layers.LSTM, 2), (FastGRU, keras.layers.GRU, 1)]
# Row 0 full, row 1 right-padded, row 2 all padding (the empty-shard row of
# tfpar.parallel.rows.shard_rows), row 3 a single real step.
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], bool)


def twins(fast_cls, ref_cls, units=7, **kwargs):
    """A Keras layer and the fast one with the same weights."""
    keras.utils.set_random_seed(0)
    ref = ref_cls(units, return_sequences=True, return_state=True, **kwargs)
    fast = fast_cls(units, return_sequences=True, return_state=True, **kwargs)
    x = tf.zeros([1, 2, 4])
    ref(x), fast(x)
    fast.set_weights(ref.get_weights())
    return ref, fast


def run(layer, x, mask=None, init=None):
    """Outputs, and the gradients (w.r.t. x, the initial state and the weights) of a loss
    that weighs every output and state, in a tf.function like every train step."""
    init = list(init or [])

    @tf.function
    def f():
        with tf.GradientTape() as tape:
            tape.watch([x] + init)
            out = layer(x, mask=mask, initial_state=init or None)
            weights = tf.sin(tf.range(tf.size(out[0]), dtype=tf.float32))
            loss = tf.reduce_sum(tf.reshape(out[0], [-1]) * weights)
            loss += sum(tf.reduce_sum(s * s) for s in out[1:])
        return out, tape.gradient(loss, [x] + init + layer.trainable_variables)

    out, grads = f()
    return [t.numpy() for t in out] + [tf.convert_to_tensor(g).numpy() for g in grads]


def assert_same(fast_values, ref_values, atol=1e-5):
    assert len(fast_values) == len(ref_values)
    for b, a in zip(fast_values, ref_values):
        assert b.shape == a.shape
        np.testing.assert_allclose(b, a, atol=atol)


@pytest.mark.parametrize("fast_cls,ref_cls,n_state", PAIRS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_outputs_states_and_gradients_match_keras(fast_cls, ref_cls, n_state, masked, with_state):
    ref, fast = twins(fast_cls, ref_cls)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(4, 5, 4)), tf.float32)
    mask = tf.constant(MASK) if masked else None
    init = [tf.constant(rng.normal(size=(4, 7)), tf.float32) for _ in range(n_state)] \
        if with_state else None
    got, want = run(fast, x, mask, init), run(ref, x, mask, init)
    assert len(got) == 1 + n_state + 1 + (n_state if with_state else 0) + 3
    assert_same(got, want)


@pytest.mark.parametrize("fast_cls,ref_cls,n_state", PAIRS)
def test_padded_row_keeps_its_state_and_repeats_its_output(fast_cls, ref_cls, n_state):
    _, fast = twins(fast_cls, ref_cls)
    x = tf.random.stateless_normal([1, 5, 4], seed=[1, 2])
    short = fast(x[:, :3])
    padded = fast(x, mask=tf.constant([[True, True, True, False, False]]))
    for a, b in zip(short[1:], padded[1:]):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-6)
    # Keras repeats the last real output at padded steps.
    np.testing.assert_allclose(padded[0][:, 3].numpy(), short[0][:, 2].numpy(), atol=1e-6)
    np.testing.assert_allclose(padded[0][:, 4].numpy(), short[0][:, 2].numpy(), atol=1e-6)


@pytest.mark.parametrize("fast_cls,ref_cls,n_state", PAIRS)
def test_bfloat16_matmuls_stay_close(fast_cls, ref_cls, n_state):
    ref, fast = twins(fast_cls, ref_cls)
    fast.matmul_dtype = "bfloat16"
    x = tf.random.stateless_normal([4, 5, 4], seed=[5, 6])
    got, want = run(fast, x, tf.constant(MASK)), run(ref, x, tf.constant(MASK))
    assert all(v.dtype == np.float32 for v in got)
    assert_same(got, want, atol=3e-2)
    assert not np.allclose(got[0], want[0], atol=1e-6)  # bfloat16 really was used


@pytest.mark.parametrize("kwargs", [{"recurrent_dropout": 0.2}, {"go_backwards": True},
                                    {"activation": "relu"}])
def test_what_the_fast_path_does_not_cover_falls_back_to_keras(kwargs):
    ref, fast = twins(FastLSTM, keras.layers.LSTM, **kwargs)
    x = tf.random.stateless_normal([2, 4, 4], seed=[7, 8])
    for a, b in zip(ref(x), fast(x)):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-6)


def test_input_dropout_matches_keras_in_inference_and_drops_in_training():
    ref, fast = twins(FastLSTM, keras.layers.LSTM, dropout=0.5)
    x = tf.random.stateless_normal([2, 4, 4], seed=[9, 10])
    np.testing.assert_allclose(fast(x)[0].numpy(), ref(x)[0].numpy(), atol=1e-6)
    assert not np.allclose(fast(x, training=True)[0].numpy(), fast(x)[0].numpy())


def test_config_round_trip_keeps_matmul_dtype():
    layer = FastLSTM(5, matmul_dtype="bfloat16", name="x")
    copy = FastLSTM.from_config(layer.get_config())
    assert copy.matmul_dtype == "bfloat16" and copy.units == 5


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_model_has_the_same_weights_and_close_logits(tie):
    from tfpar.model.lm import build_model

    cfg = model_config(embed_dim=16, hidden_dim=16, layers=2, tie_embeddings=tie)
    fp32 = build_model(cfg, 30)
    bf16 = build_model(model_config(**{**cfg.__dict__, "precision": "bf16"}), 30)
    assert [v.path for v in bf16.weights] == [v.path for v in fp32.weights]
    bf16.set_weights(fp32.get_weights())
    ids = tf.constant([[2, 3, 4, 0], [5, 6, 0, 0]])
    (a, _), (b, _) = fp32(ids), bf16(ids)
    assert b.dtype == tf.float32
    np.testing.assert_allclose(b.numpy(), a.numpy(), atol=2e-2)
    assert not np.allclose(b.numpy(), a.numpy(), atol=1e-7)


def _xla_calls(concrete) -> int:
    """How many XLA-compiled function calls a traced graph makes (its own or nested)."""
    graph = concrete.graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sum(1 for n in nodes if "_XlaMustCompile" in n.attr and n.attr["_XlaMustCompile"].b)


@pytest.mark.parametrize("fast_cls,ref_cls,n_state", PAIRS)
def test_fixed_shapes_compile_the_loops_and_varying_shapes_do_not(fast_cls, ref_cls, n_state):
    _, fast = twins(fast_cls, ref_cls)
    x = tf.constant(np.random.default_rng(2).normal(size=(4, 5, 4)), tf.float32)
    mask = tf.constant(MASK)

    def loss_and_grads(x, mask):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = fast(x, mask=mask)[0]
            loss = tf.reduce_sum(out * tf.sin(tf.range(7, dtype=tf.float32)))
        return [loss] + tape.gradient(loss, [x] + fast.trainable_variables)

    fixed = tf.function(loss_and_grads)
    varying = tf.function(loss_and_grads, input_signature=[
        tf.TensorSpec([None, None, 4], tf.float32), tf.TensorSpec([None, None], tf.bool)])
    # Forward and backward loop (and the cross-entropy is not in here): 2 compiled calls.
    assert _xla_calls(fixed.get_concrete_function(x, mask)) == 2
    assert _xla_calls(varying.get_concrete_function()) == 0
    assert_same([t.numpy() for t in fixed(x, mask)], [t.numpy() for t in varying(x, mask)],
                atol=1e-6)
