"""On a GPU, FastLSTM/FastGRU take Keras' cuDNN path; on a CPU the fast recurrence.

This host has no GPU, so the tests make TensorFlow report one (``list_logical_devices``
patched: what tfpar's :func:`~tfpar.model.layers.runs_on_gpu` and Keras' ``cudnn_ok``
ask) and replace the cuDNN kernel, ``tf.raw_ops.CudnnRNNV3``, by an emulation of its
documented contract written here with plain TensorFlow: weights in cuDNN's layout
(transposed per gate, input and recurrent biases apart), batch-major input, one sequence
length per row, zeros as output past a row's length, the final state taken at it. The
emulation records each call, so a test sees which path a layer took and with what
arguments (the dropped recurrent matrix, the carried state, the mask), and the model's
loss and gradients through it are compared with the fast recurrence's.
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from conftest import model_config
from tfpar import compat
from tfpar.model import layers
from tfpar.model.lm import build_model
from tfpar.objective.losses import nll_sum_and_count

V = 30
MODEL = model_config(embed_dim=8, hidden_dim=6, layers=2)
# Right-padded sentences (0 = padding) and one row with no token at all (an empty
# shard's padding row): cuDNN refuses length 0, so its first step goes in unmasked.
INPUTS = np.array([[5, 6, 7, 8, 9], [3, 4, 0, 0, 0], [0, 0, 0, 0, 0], [11, 12, 13, 0, 0]],
                  np.int32)
TARGETS = np.array([[6, 7, 8, 9, 2], [4, 2, 0, 0, 0], [0, 0, 0, 0, 0], [12, 13, 2, 0, 0]],
                   np.int32)
FAKE_GPU = [tf.config.LogicalDevice("/device:GPU:0", "GPU")]


def cudnn_lstm(calls):
    """``tf.raw_ops.CudnnRNNV3`` for ``rnn_mode="lstm"``, batch-major, recording calls."""
    def op(*, input, input_h, input_c, params, is_training, rnn_mode, sequence_lengths,
           time_major, name=None):
        assert rnn_mode == "lstm" and not time_major

        def record(lengths, h0, params):  # when the op runs (not when it is traced)
            calls.append(dict(lengths=lengths, h0=h0, params=params))
            return np.int32(0)
        ran = tf.numpy_function(record, [sequence_lengths, input_h[:, 0], params], tf.int32)
        with tf.control_dependencies([ran]):
            input = tf.identity(input)
        d, h = input.shape[-1], input_h.shape[-1]
        parts = tf.split(params, [h * d] * 4 + [h * h] * 4 + [h] * 8)
        kernel = tf.concat([tf.transpose(tf.reshape(p, [h, d])) for p in parts[:4]], 1)
        recurrent = tf.concat([tf.transpose(tf.reshape(p, [h, h])) for p in parts[4:8]], 1)
        bias = tf.concat([parts[8 + i] + parts[12 + i] for i in range(4)], 0)
        steps = tf.range(tf.shape(input)[1])

        def step(carry, xt):
            hp, cp, _ = carry
            x, t = xt
            i, f, g, o = tf.split(x @ kernel + hp @ recurrent + bias, 4, axis=1)
            c = tf.sigmoid(f) * cp + tf.sigmoid(i) * tf.tanh(g)
            hn = tf.sigmoid(o) * tf.tanh(c)
            live = (t < sequence_lengths)[:, None]
            return (tf.where(live, hn, hp), tf.where(live, c, cp),
                    tf.where(live, hn, tf.zeros_like(hn)))

        h0, c0 = input_h[:, 0], input_c[:, 0]
        hs, cs, outs = tf.scan(step, (tf.transpose(input, [1, 0, 2]), steps),
                               initializer=(h0, c0, tf.zeros_like(h0)))
        return (tf.transpose(outs, [1, 0, 2]), hs[-1][:, None], cs[-1][:, None],
                tf.zeros([0]), tf.zeros([0]))
    return op


@pytest.fixture
def gpu_visible(monkeypatch):
    """TensorFlow reports one GPU; CudnnRNNV3 is the recording emulation. Yields the
    list of its calls."""
    real = tf.config.list_logical_devices
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: FAKE_GPU if kind == "GPU" else real(kind))
    calls = []
    monkeypatch.setattr(tf.raw_ops, "CudnnRNNV3", cudnn_lstm(calls))
    return calls


def training_step(model, inputs, targets, state=None, device=None):
    """A tf.function traced as a training step is (``device``: a placement scope around
    the model), returning the mean NLL over the real tokens, the logits [B, T, V], the
    gradients and the final state."""
    @tf.function
    def run():
        with tf.GradientTape() as tape, tf.device(device):
            logits, final = model(inputs, initial_state=state, training=True)
            nll, count = nll_sum_and_count(logits, targets)
            loss = nll / count
        return loss, logits, tape.gradient(loss, model.trainable_variables), final
    return run


def loss_and_grads(model, inputs, targets, state=None, device=None):
    """:func:`training_step`'s loss, gradients and final state."""
    loss, _, grads, final = training_step(model, inputs, targets, state, device)()
    return loss, grads, final


def make(config=MODEL, seed=0):
    model = build_model(config, V, seed=seed, fixed_shapes=False)
    model.noise.step = lambda: tf.constant(7, tf.int64)  # this step's dropout masks
    return model


@pytest.mark.parametrize("weight_drop", [0.0, 0.5])
def test_a_layer_on_a_gpu_takes_keras_cudnn_path_with_the_same_loss(gpu_visible, weight_drop):
    """Two LSTM layers, sentence batches with padding and an empty row, dropout and weight
    drop: both layers go through cuDNN (one call each), each with its row lengths (the
    empty row as 1), and the loss over real tokens and every gradient equal the fast
    recurrence's. With weight drop, cuDNN gets the dropped recurrent matrix."""
    config = dataclasses.replace(MODEL, dropout=0.2, weight_drop=weight_drop)
    model = make(config)
    cudnn_loss, cudnn_grads, _ = loss_and_grads(model, INPUTS, TARGETS)
    assert len(gpu_visible) == 2  # one call per layer
    for call in gpu_visible:
        assert call["lengths"].tolist() == [5, 2, 1, 3]

    recurrent = model.rnns[0].cell.recurrent_kernel.numpy()  # [H, 4H]
    h, d = MODEL.hidden_dim, MODEL.embed_dim
    sent = gpu_visible[0]["params"][4 * h * d:4 * h * d + 4 * h * h]
    sent = np.concatenate([sent[i * h * h:(i + 1) * h * h].reshape(h, h).T for i in range(4)],
                          axis=1)
    dropped = sent == 0
    assert (dropped.sum() > 0.3 * recurrent.size) == (weight_drop > 0)  # ~half the entries
    # The kept entries, scaled by 1 / (1 - p) as dropout scales.
    np.testing.assert_allclose(sent[~dropped], recurrent[~dropped] / (1 - weight_drop),
                               rtol=1e-6)

    gpu_visible.clear()
    with pytest.MonkeyPatch.context() as patch:  # back on CPUs: the fast recurrence
        patch.setattr(layers, "runs_on_gpu", lambda probe: False)
        fast_loss, fast_grads, _ = loss_and_grads(model, INPUTS, TARGETS)
    assert gpu_visible == []
    assert float(cudnn_loss) == pytest.approx(float(fast_loss), rel=1e-6)
    for a, b, v in zip(cudnn_grads, fast_grads, model.trainable_variables):
        np.testing.assert_allclose(np.asarray(tf.convert_to_tensor(a)),
                                   np.asarray(tf.convert_to_tensor(b)),
                                   rtol=1e-4, atol=1e-6, err_msg=v.path)


def test_stream_mode_carries_its_state_through_cudnn(gpu_visible):
    """A window of full rows (no padding) started from a carried state: cuDNN gets that
    state as its initial one, and the final state it returns equals the fast path's."""
    model = make()
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, V, size=(3, 4)).astype(np.int32)
    targets = rng.integers(1, V, size=(3, 4)).astype(np.int32)
    state = [[tf.constant(rng.normal(size=(3, MODEL.hidden_dim)), tf.float32)
              for _ in range(2)] for _ in range(MODEL.layers)]
    loss, _, final = loss_and_grads(model, inputs, targets, state)
    assert [c["lengths"].tolist() for c in gpu_visible] == [[4, 4, 4]] * 2
    np.testing.assert_array_equal(gpu_visible[0]["h0"], state[0][0].numpy())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "runs_on_gpu", lambda probe: False)
        fast_loss, _, fast_final = loss_and_grads(model, inputs, targets, state)
    assert float(loss) == pytest.approx(float(fast_loss), rel=1e-6)
    for got, want in zip(tf.nest.flatten(final), tf.nest.flatten(fast_final)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_the_device_a_layer_runs_on_decides(gpu_visible):
    """On a GPU host a layer placed on /cpu:0 (a tower pinned to the CPU) keeps the fast
    recurrence; one placed on /gpu:0 takes cuDNN; with no GPU at all, no call."""
    model = make()
    loss_and_grads(model, INPUTS, TARGETS, device="/cpu:0")
    assert gpu_visible == []
    loss_and_grads(model, INPUTS, TARGETS, device="/gpu:0")
    assert len(gpu_visible) == 2


def test_without_a_gpu_the_fast_recurrence_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(tf.raw_ops, "CudnnRNNV3", cudnn_lstm(calls))
    loss_and_grads(make(), INPUTS, TARGETS)
    assert calls == []


def test_bf16_matmuls_and_other_math_keep_their_paths(gpu_visible):
    """--precision bf16's hand-cast matmuls stay on the fast path (cuDNN has no such
    mode); a GRU takes Keras' cuDNN GRU (reset_after, its default)."""
    loss_and_grads(make(dataclasses.replace(MODEL, precision="bf16")), INPUTS, TARGETS)
    assert gpu_visible == []
    gru = []

    def cudnn_gru(**kwargs):
        gru.append(kwargs["rnn_mode"])
        raise NotImplementedError  # -> the fast GRU
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compat.keras_tf_rnn(), "gru",
                      lambda *a, **k: cudnn_gru(rnn_mode="gru"))
        loss_and_grads(make(dataclasses.replace(MODEL, cell="gru")), INPUTS, TARGETS)
    assert len(gru) >= 2 and set(gru) == {"gru"}  # (called as each layer is traced)
