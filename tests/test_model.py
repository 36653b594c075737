import numpy as np
import pytest
import tensorflow as tf

from conftest import model_config, small_config, train_config
from tfpar.model.lm import build_model


@pytest.mark.parametrize("cell,layers", [("lstm", 1), ("gru", 2), ("lstm", 3)])
def test_shapes_and_named_parts(cell, layers):
    model = build_model(model_config(cell=cell, layers=layers, embed_dim=8, hidden_dim=12), 30)
    logits, state = model(tf.constant([[2, 3, 4, 0], [2, 5, 0, 0]]))
    assert logits.shape == (2, 4, 30)
    assert len(state) == layers
    assert all(len(s) == (2 if cell == "lstm" else 1) for s in state)
    assert all(t.shape == (2, 12) for s in state for t in s)
    names = {v.path.split("/")[1] for v in model.trainable_variables}
    assert names == {"embedding", "softmax"} | {f"rnn_{i}" for i in range(layers)}


def test_same_seed_same_weights_other_seed_other_weights():
    cfg = model_config(embed_dim=8, hidden_dim=8)
    a, b, c = build_model(cfg, 20, seed=1), build_model(cfg, 20, seed=1), build_model(cfg, 20, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a.get_weights(), b.get_weights()))
    assert not all(np.array_equal(x, y) for x, y in zip(a.get_weights(), c.get_weights()))


def test_padding_does_not_change_real_positions_or_final_state():
    model = build_model(model_config(embed_dim=8, hidden_dim=8), 20)
    short, short_state = model(tf.constant([[2, 3, 4]]))
    padded, padded_state = model(tf.constant([[2, 3, 4, 0, 0]]))
    np.testing.assert_allclose(padded[:, :3].numpy(), short.numpy(), atol=1e-6)
    for a, b in zip(short_state[0], padded_state[0]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_state_carries_across_windows():
    model = build_model(model_config(embed_dim=8, hidden_dim=8, layers=2), 20)
    full, _ = model(tf.constant([[2, 3, 4, 5, 6, 7]]))
    first, state = model(tf.constant([[2, 3, 4]]))
    second, _ = model(tf.constant([[5, 6, 7]]), initial_state=state)
    np.testing.assert_allclose(np.concatenate([first, second], 1), full.numpy(), atol=1e-5)


def test_tied_embeddings_share_the_matrix():
    model = build_model(model_config(embed_dim=8, hidden_dim=8, tie_embeddings=True), 20)
    paths = [v.path for v in model.trainable_variables]
    assert "rnn_lm/softmax/kernel" not in paths and "rnn_lm/softmax/bias" in paths


def test_tied_embeddings_with_a_wider_rnn_project_to_the_embedding_width():
    model = build_model(model_config(embed_dim=8, hidden_dim=16, tie_embeddings=True), 20)
    shapes = {v.path: tuple(v.shape) for v in model.trainable_variables}
    assert shapes["rnn_lm/softmax/projection"] == (16, 8)
    assert "rnn_lm/softmax/kernel" not in shapes and shapes["rnn_lm/embedding/embeddings"] == \
        (20, 8)
    logits, _ = model(tf.constant([[2, 3, 4]]))
    h = model.run_rnn(0, *model.embed(tf.constant([[2, 3, 4]])))[0]
    want = h.numpy() @ model.softmax.projection.numpy() @ \
        model.embedding.embeddings.numpy().T + model.softmax.bias.numpy()
    np.testing.assert_allclose(logits.numpy(), want, atol=1e-5)


def test_weight_decay_shrinks_every_weight_by_lr_times_decay():
    from tfpar.training.schedule import optimizer_factory

    model = build_model(model_config(embed_dim=8, hidden_dim=8), 20)
    config = small_config(train=train_config(optimizer="sgd", lr=0.5, weight_decay=0.1))
    optimizer = optimizer_factory(config.train, 1)(tf.Variable(0, dtype=tf.int64), tf.Variable(1.0))
    before = [v.numpy() for v in model.trainable_variables]
    optimizer.apply_gradients([(tf.zeros_like(v), v) for v in model.trainable_variables])
    for old, v in zip(before, model.trainable_variables):
        np.testing.assert_allclose(v.numpy(), old * (1 - 0.5 * 0.1), rtol=1e-6, atol=1e-7)


def test_every_layer_is_in_a_checkpoint(tmp_path):
    model = build_model(model_config(embed_dim=8, hidden_dim=8, layers=2, dropout=0.1), 20)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    saved = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    for name in ("model/rnn_0/", "model/rnn_1/", "model/embedding/", "model/softmax/"):
        assert any(k.startswith(name) for k in saved), name
    copy = build_model(model_config(embed_dim=8, hidden_dim=8, layers=2, dropout=0.1), 20, seed=9)
    tf.train.Checkpoint(model=copy).restore(path).assert_existing_objects_matched()
    assert all(np.array_equal(x, y) for x, y in zip(model.get_weights(), copy.get_weights()))
