"""What tfpar relies on in each private API it uses (``tfpar.compat``), tested as behaviour.

One test (or two) per fenced use, each failing the day TensorFlow, Keras or argparse
changes what tfpar needs - a renamed method, a changed signature, a protocol no longer
called - rather than checking that a name exists. Tiny tensors, one update at most.
"""

import argparse
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_cudnn import gpu_visible  # noqa: F401  (a GPU reported, CudnnRNNV3 emulated)
from tfpar import compat

CPU = ("/device:CPU:0", "/device:CPU:1")


# ----------------------------------------------------------- TypeSpec rank-only relaxation
def test_a_rank_only_spec_keeps_ranks_and_forgets_sizes_also_per_replica():
    """``any_shape_specs`` traces the step once for every batch shape: the spec of a
    tensor and of a PerReplica (one spec per replica) have every dimension unknown, and a
    function traced with one takes other shapes without a second trace."""
    assert compat.rank_only_spec(tf.zeros([2, 3], tf.int32)) == tf.TensorSpec([None, None],
                                                                              tf.int32)
    strategy = tf.distribute.MirroredStrategy(CPU)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.zeros([ctx.replica_id_in_sync_group + 1, 4]))
    specs = tf.nest.flatten(compat.rank_only_spec(per_replica), expand_composites=True)
    assert [s.shape.as_list() for s in specs] == [[None, None]] * 2

    f = tf.function(lambda x: tf.shape(x), autograph=False)
    f.get_concrete_function(compat.rank_only_spec(tf.zeros([2, 3])))
    assert f(tf.zeros([5, 7])).numpy().tolist() == [5, 7]
    assert f.experimental_get_tracing_count() == 1


# ------------------------------------------------ the optimizer's replica-context sum
def sgd_update(strategy, rows_of_replica):
    """One SGD(0.1) update of w [3] under ``strategy`` on x [4, 3], loss
    sum((x @ w)^2): each replica's gradient on its rows, summed across replicas by the
    strategy (as tfpar's plug-in sums), applied on every replica by an optimizer told the
    sum is done. Returns w after the update."""
    x = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.5, -1.0, 2.0], [3.0, 0.0, -1.0]])
    with strategy.scope():
        w = keras.Variable([1.0, -2.0, 0.5])
        optimizer = compat.summed_already(keras.optimizers.SGD(0.1))
        optimizer.build([w])

    def gradient():
        rows = rows_of_replica(x)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.linalg.matvec(rows, w.value)))
        return tape.gradient(loss, w.value)

    @tf.function(autograph=False)
    def step():
        grads = strategy.run(gradient)
        summed = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(grads, grads)])[0]
        strategy.run(lambda g: optimizer.apply_gradients([(g, w)]), args=(summed,))

    step()
    return w.numpy()


def test_a_mirrored_update_of_summed_gradients_equals_one_devices():
    """Two replicas, two rows each: the update equals the default strategy's on the four
    rows. Were Keras' ``apply`` to all-reduce again (the patched method renamed or no
    longer called), the step would be twice the default's."""
    mirrored = tf.distribute.MirroredStrategy(CPU)

    def half(x):
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return x[2 * r:2 * r + 2]

    want = sgd_update(tf.distribute.get_strategy(), lambda x: x)
    assert not np.allclose(want, [1.0, -2.0, 0.5])  # it moved
    np.testing.assert_allclose(sgd_update(mirrored, half), want, rtol=1e-6)


def test_summed_already_passes_the_gradients_through_and_patches_the_instance():
    optimizer = keras.optimizers.SGD(1.0)
    assert compat.summed_already(optimizer) is optimizer
    pairs = [(tf.constant([1.0]), "v0"), (tf.constant([2.0]), "v1")]
    assert optimizer._all_reduce_sum_gradients(iter(pairs)) == pairs
    assert "_all_reduce_sum_gradients" not in vars(keras.optimizers.SGD(1.0))  # per instance
    wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    assert compat.summed_already(wrapped) is wrapped  # and its inner optimizer
    assert "_all_reduce_sum_gradients" in vars(wrapped.inner_optimizer)


def test_an_optimizer_without_the_replica_sum_is_refused_in_one_line():
    """An optimizer that would sum the replicas' gradients where tfpar cannot switch the
    sum off would apply them R times: refused, naming the class."""
    class Summing:
        pass

    with pytest.raises(RuntimeError, match=r"^this Keras' Summing has no "
                       r"_all_reduce_sum_gradients: tfpar needs Keras 3's TensorFlow "
                       r"optimizer \(it hands it gradients summed already\)$"):
        compat.summed_already(Summing())


# ----------------------------------------------------------- the rate's schedule object
def test_the_learning_rate_source_is_the_schedule_given():
    """The schedule read back is the object the optimizer was built with (so tfpar can
    evaluate it at the step just taken); a constant rate is no schedule."""
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert compat.learning_rate_source(keras.optimizers.SGD(schedule)) is schedule
    wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(schedule))
    assert compat.learning_rate_source(wrapped.inner_optimizer) is schedule
    constant = compat.learning_rate_source(keras.optimizers.SGD(0.25))
    assert not isinstance(constant, keras.optimizers.schedules.LearningRateSchedule)
    assert float(constant) == 0.25


# ------------------------------------------------------------- Keras' cuDNN functions
B, T, D, H = 2, 3, 4, 5


def lstm_weights():
    rng = np.random.default_rng(0)
    return [tf.constant(rng.normal(size=s).astype(np.float32) * 0.3)
            for s in ([D, 4 * H], [H, 4 * H], [4 * H])]


def test_keras_rnn_functions_are_the_layers_entry_points_and_decline_on_a_cpu():
    """``lstm``/``gru`` are what ``keras.layers.LSTM``/``GRU`` call, take tfpar's
    arguments, and raise NotImplementedError without a GPU (tfpar's cue to take its fast
    recurrence; any other error would escape the layer)."""
    rnn = compat.keras_tf_rnn()
    from keras.src import backend  # what keras.layers.LSTM/GRU call

    assert backend.lstm is rnn.lstm and backend.gru is rnn.gru
    kernel, recurrent, bias = lstm_weights()
    x, h, mask = tf.zeros([B, T, D]), tf.zeros([B, H]), tf.ones([B, T], tf.bool)
    with pytest.raises(NotImplementedError):
        rnn.lstm(x, h, h, mask, kernel=kernel, recurrent_kernel=recurrent, bias=bias,
                 activation=tf.tanh, recurrent_activation=tf.sigmoid, return_sequences=True)
    with pytest.raises(NotImplementedError):
        rnn.gru(x, h, mask, kernel=kernel[:, :3 * H], recurrent_kernel=recurrent[:, :3 * H],
                bias=tf.zeros([2, 3 * H]), activation=tf.tanh, recurrent_activation=tf.sigmoid,
                return_sequences=True, reset_after=True)


def test_keras_cudnn_lstm_on_a_gpu_computes_what_keras_lstm_does(gpu_visible):
    """With a GPU reported and CudnnRNNV3 emulated (tests/test_cudnn.py), ``lstm`` on
    tfpar's arguments (a right-padded row) returns ``(last, outputs, [h, c])`` equal to
    ``keras.layers.LSTM``'s own loop on the same weights."""
    kernel, recurrent, bias = lstm_weights()
    x = tf.constant(np.random.default_rng(1).normal(size=[B, T, D]).astype(np.float32))
    mask = tf.constant([[True, True, True], [True, True, False]])
    h0 = tf.fill([B, H], 0.1)
    c0 = tf.fill([B, H], -0.2)
    last, outputs, (h, c) = compat.keras_tf_rnn().lstm(
        x, h0, c0, mask, kernel=kernel, recurrent_kernel=recurrent, bias=bias,
        activation=tf.tanh, recurrent_activation=tf.sigmoid, return_sequences=True)
    assert len(gpu_visible) == 1

    layer = keras.layers.LSTM(H, return_sequences=True, return_state=True, use_cudnn=False)
    layer.build((B, T, D))
    layer.set_weights([kernel.numpy(), recurrent.numpy(), bias.numpy()])
    want_outputs, want_h, want_c = layer(x, initial_state=[h0, c0], mask=mask)
    np.testing.assert_allclose(h.numpy(), want_h.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.numpy(), want_c.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last.numpy(), want_h.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs.numpy()[0], want_outputs.numpy()[0], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(outputs.numpy()[1, :2], want_outputs.numpy()[1, :2],
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- SavedModel proto
def test_a_saved_models_proto_names_each_signatures_function_and_holds_its_graph(tmp_path):
    """``check_servable`` reads what a signature runs from the written file: the object
    graph's ``signatures`` node names each signature's function, whose graph, and those
    of the functions it calls, are in the library (a numpy_function two calls deep)."""
    from tfpar.serving.export import _ops_called

    inner = tf.function(lambda v: tf.numpy_function(lambda a: a * 2, [v], tf.float32),
                        autograph=False)

    class Doubler(tf.Module):
        @tf.function(autograph=False, input_signature=[tf.TensorSpec([None], tf.float32)])
        def double(self, x):
            return {"y": inner(x) + 0.0}

    module = Doubler()
    tf.saved_model.save(module, str(tmp_path), signatures={"double": module.double})
    meta = compat.read_saved_model(str(tmp_path)).meta_graphs[0]
    library = {f.signature.name: f for f in meta.graph_def.library.function}
    nodes = meta.object_graph_def.nodes
    signatures = next(c for c in nodes[0].children if c.local_name == "signatures")
    [child] = nodes[signatures.node_id].children
    assert child.local_name == "double"
    name = nodes[child.node_id].bare_concrete_function.concrete_function_name
    assert name in library
    assert "PyFunc" in _ops_called(name, library)
    assert "PyFunc" not in {n.op for n in library[name].node_def}  # found by the calls


# ------------------------------------------------------------------- ShardedVariable
def test_a_sharded_keras_variable_round_trips_a_checkpoint(tmp_path):
    """A Keras variable over ``CheckpointedShards`` (two shards of rows) saves its whole
    value, restores it, and the checkpoint restores into an unsharded Keras variable."""
    value = np.arange(10, dtype=np.float32).reshape(5, 2)
    shards_type = compat.checkpointed_shards_type()
    assert issubclass(shards_type, compat.sharded_variable_type())

    def split(next_creator, **kwargs):
        parts = [next_creator(initial_value=part, name=f"part_{i}", dtype=tf.float32)
                 for i, part in enumerate((value[:3], value[3:]))]
        return shards_type(parts, name="table")

    with tf.variable_creator_scope(split):
        sharded = keras.Variable(value)
    assert [v.shape.as_list() for v in sharded.value.variables] == [[3, 2], [2, 2]]
    path = tf.train.Checkpoint(v=sharded).save(str(tmp_path / "ckpt"))
    sharded.assign(np.zeros_like(value))
    tf.train.Checkpoint(v=sharded).restore(path).assert_consumed()
    np.testing.assert_array_equal(sharded.numpy(), value)
    plain = keras.Variable(np.zeros_like(value))
    tf.train.Checkpoint(v=plain).restore(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), value)


# ----------------------------------------------------------------- the stack walk
class Stack(keras.Model):
    """A subclassed model built deferred (tfpar's model builds its weights this way)."""

    def __init__(self):
        super().__init__(name="stack")
        self.first = keras.layers.Dense(3, name="first")
        self.second = keras.layers.Dense(2, name="second")

    def call(self, x):
        return self.second(self.first(x))


def test_the_stack_walk_finds_each_created_variables_keras_path():
    """Inside a variable creator, the path found is the ``.path`` of the Keras variable
    being created: the model's weights and the optimizer's slots."""
    seen = []

    def creator(next_creator, **kwargs):
        seen.append(compat.creating_keras_variable_path())
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        model = Stack()
        model(tf.zeros([1, 4]))
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
    want = [v.path for v in model.variables + optimizer.variables]
    assert "stack/first/kernel" in want
    assert sorted(seen, key=str) == sorted(want)


# ------------------------------------------------------------------------- argparse
def test_parser_actions_list_every_argument_and_find_the_subcommands():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float)
    group = parser.add_argument_group("model")
    group.add_argument("--bptt", type=int)
    subcommands = parser.add_subparsers(dest="command")
    go = subcommands.add_parser("go")
    actions = compat.parser_actions(parser)
    assert [a.dest for a in actions] == ["help", "lr", "bptt", "command"]
    assert [compat.is_subcommands(a) for a in actions] == [False, False, False, True]
    assert actions[-1].choices == {"go": go}
    assert isinstance(group, compat.ArgumentGroup)


def test_the_fence_names_no_private_api_outside_its_functions():
    """Every function of compat says why and for which versions (the module's rule)."""
    for name, obj in vars(compat).items():
        if inspect.isfunction(obj) and not name.startswith("_") \
                and obj.__module__ == compat.__name__:
            assert "Private:" in obj.__doc__ and "Checked:" in obj.__doc__, name

