"""Every private TensorFlow, Keras and argparse API tfpar uses, and why.

Where TensorFlow or Keras offers no public way to do what tfpar needs, the private use
sits here, as one small named function, beside the public API that is missing and the
versions it was checked on. The rest of the package calls these functions and reaches
into no foreign private name itself (``tests/test_architecture.py`` checks the parsed
source). Each use has a behaviour test in ``tests/test_compat.py`` that fails the day
TensorFlow or Keras changes what tfpar relies on - not a ``hasattr`` that a renamed
method would pass, and never a patch that silently stops applying.

Checked on TensorFlow 2.21 and Keras 3.15 (pyproject pins both to that minor version);
argparse on Python 3.10-3.13.

Nothing here imports TensorFlow or Keras at module level: the command-line tools use the
argparse helpers, and a command must set TensorFlow's log level and split the CPU into
logical devices before TensorFlow is imported (``tfpar.tools.cli``). The TensorFlow and
Keras uses import them inside the function.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
from typing import Any

# ------------------------------------------------------------------------ TensorFlow


def rank_only_spec(value) -> Any:
    """The ``tf.TypeSpec`` of ``value`` (a tensor or a composite such as a PerReplica)
    with every dimension unknown and the ranks kept: [b, T] -> [None, None].

    Private: ``TypeSpec._with_tensor_ranks_only``, what ``tf.function``'s
    ``reduce_retracing`` gives its later traces. No public API relaxes a spec's shapes,
    and for a composite (a PerReplica's spec is one spec per replica) tfpar would have to
    rebuild each kind of spec itself. Used by ``tfpar.objective.step.any_shape_specs``.
    Checked: TensorFlow 2.21.
    """
    import tensorflow as tf

    return tf.type_spec_from_value(value)._with_tensor_ranks_only()


@functools.cache
def sharded_variable_type() -> type:
    """``tf.__internal__.distribute.ShardedVariable``, the class of a variable a
    ``ParameterServerStrategy`` partitions (``variable_partitioner``).

    Private: TensorFlow creates such variables but exports the class only under
    ``tf.__internal__``; tfpar needs it to recognise one (its ``.variables`` are the
    shards a gradient is taken with respect to) and to subclass it
    (:func:`checkpointed_shards_type`). Checked: TensorFlow 2.21.
    """
    import tensorflow as tf

    return tf.__internal__.distribute.ShardedVariable


@functools.cache
def checkpointed_shards_type() -> type:
    """A ``ShardedVariable`` subclass a Keras 3 variable can checkpoint.

    A Keras variable saves what it wraps through the Trackable saving protocol,
    ``_serialize_to_tensors`` / ``_restore_from_tensors`` (private names: the protocol
    ``tf.train.Checkpoint`` calls, with no public way to implement it), which
    ``ShardedVariable`` lacks (it has only legacy saveables), and then fails. This class
    saves the whole value under the Keras variable's key - the checkpoint an unsharded
    variable writes, so any strategy can restore it - and restores by slicing
    (``assign`` of a ShardedVariable). Made with ``CheckpointedShards(shards, name=...)``.
    Checked: TensorFlow 2.21, Keras 3.15.
    """
    import tensorflow as tf

    class CheckpointedShards(sharded_variable_type()):
        def _serialize_to_tensors(self):
            return {"VARIABLE_VALUE": tf.convert_to_tensor(self)}

        def _restore_from_tensors(self, restored_tensors):
            return self.assign(restored_tensors["VARIABLE_VALUE"])

    CheckpointedShards.__module__ = __name__
    CheckpointedShards.__qualname__ = "CheckpointedShards"
    return CheckpointedShards


def read_saved_model(path: str):
    """The ``SavedModel`` protocol buffer of the SavedModel folder ``path`` (its
    ``saved_model.pb``): the graphs of its functions and its object graph, where each
    signature names the function that serves it.

    Private: the module ``tensorflow.core.protobuf.saved_model_pb2``, the format's own
    definition. TensorFlow has no public reader of a SavedModel's graphs short of
    loading it (``tf.saved_model.load`` builds every function again, the cost of a second
    export). Used by ``tfpar.serving.export.check_servable``. Checked: TensorFlow 2.21.
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    with tf.io.gfile.GFile(f"{path.rstrip('/')}/saved_model.pb", "rb") as f:
        proto.ParseFromString(f.read())
    return proto


# ----------------------------------------------------------------------------- Keras


def _as_given(grads_and_vars):
    return list(grads_and_vars)


def summed_already(optimizer):
    """Makes ``optimizer.apply_gradients`` apply the gradients it is given as they are,
    without all-reducing them over the replicas (tfpar hands it sums). Returns it.

    Private: Keras 3's TensorFlow optimizer sums the gradients in
    ``_all_reduce_sum_gradients``, called from ``apply`` when in a replica context, and
    has no public switch for gradients that are summed already (Keras 2's
    ``apply_gradients(..., skip_gradients_aggregation=True)`` is gone). tfpar sums once
    itself, before the update, because the clip factor needs the norm of the sum; a second
    sum would multiply every update by the replica count. The method is replaced on the
    instance, once, for the optimizer's life: the replicas of a MirroredStrategy trace
    ``apply`` on threads of their own at the same time, so a patch put on and taken off
    around each call would race. Under loss scaling the wrapped optimizer is the one that
    applies (and sums), so it is patched too. Checked: Keras 3.15.

    Raises:
      RuntimeError: an optimizer without the method (not Keras 3's TensorFlow optimizer),
        which would sum a second time where tfpar cannot switch it off.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None:
            continue
        if not hasattr(opt, "_all_reduce_sum_gradients"):
            raise RuntimeError(f"this Keras' {type(opt).__name__} has no "
                               "_all_reduce_sum_gradients: tfpar needs Keras 3's TensorFlow "
                               "optimizer (it hands it gradients summed already)")
        opt._all_reduce_sum_gradients = _as_given
    return optimizer


def learning_rate_source(optimizer):
    """What ``optimizer`` (a Keras 3 optimizer, not a loss-scale wrapper) computes its rate
    from: the ``LearningRateSchedule`` or callable it was given, or the variable it holds
    a constant rate in.

    Private: ``optimizer._learning_rate``. The public ``optimizer.learning_rate``
    evaluates a schedule at ``optimizer.iterations`` - after update n, update n+1's rate -
    and Keras has no public getter for the schedule itself, which tfpar needs to report
    the rate update n was applied with (``tfpar.training.schedule.applied_learning_rate``).
    Read directly, not with a default: a rename fails here instead of reporting the next
    step's rate. Checked: Keras 3.15.
    """
    return optimizer._learning_rate


def keras_tf_rnn():
    """Keras' TensorFlow-backend RNN module, ``keras.src.backend.tensorflow.rnn``.

    Private: its ``lstm(inputs, initial_state_h, initial_state_c, mask, *, kernel,
    recurrent_kernel, bias, activation, recurrent_activation, return_sequences)`` and
    ``gru(inputs, initial_state, mask, *, ..., reset_after)`` are the cuDNN entry points
    ``keras.layers.LSTM``/``GRU`` call, and raise NotImplementedError when cuDNN cannot
    run (no GPU, unsupported arguments), which tfpar's fast layers take as "use the fast
    recurrence". Keras exports no public function that runs its cuDNN kernel on given
    weights (``keras.ops`` has no ``lstm``); the alternative, ``tf.raw_ops.CudnnRNNV3``,
    would mean copying Keras' weight layout conversion. They return ``(last, outputs,
    [h, c])`` / ``(last, outputs, h)``. Used by ``tfpar.model.layers``.
    Checked: Keras 3.15.
    """
    return importlib.import_module("keras.src.backend.tensorflow.rnn")


def creating_keras_variable_path(max_depth: int = 16) -> str | None:
    """In a ``tf.variable_creator_scope`` creator: the Keras path of the ``keras.Variable``
    whose ``tf.Variable`` is being created ("rnn_lm/rnn_1/lstm_cell/kernel"), or None.

    Private: a stack walk. Keras 3 hands ``tf.Variable`` only the short name ("kernel")
    and builds a subclassed model's weights deferred, after its layers' name scopes are
    closed; the ``keras.Variable`` that asks for the ``tf.Variable`` (the ``self`` of its
    ``_initialize``, a few frames up) is the one place that still knows its path. Keras
    has no public hook that sees a variable's path before its value is placed (what the
    pipeline needs to put each weight on its stage's device). Used by
    ``tfpar.parallel.pipeline.plugin``. Checked: Keras 3.15 (the variable is 3 to 5
    frames up).
    """
    import keras

    frame = inspect.currentframe()
    try:
        for _ in range(max_depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.Variable):
                return owner.path
        return None
    finally:
        del frame


# -------------------------------------------------------------------------- argparse
# argparse has no public way to list a parser's arguments or to name the classes it
# makes; these names have been stable since Python 3.2, but they are private all the
# same, so they are fenced here like the others.

# The class of ``parser.add_argument_group()`` (for annotations).
ArgumentGroup = argparse._ArgumentGroup


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions (one per argument, ``--help`` and sub-command actions included) of
    ``parser``, in the order they were added.

    Private: ``parser._actions``. tfpar maps flags to destinations (presets, keyword
    settings, the "did you mean" of a mistyped flag); argparse exposes no list of its
    arguments. Checked: Python 3.10-3.13.
    """
    return parser._actions


def is_subcommands(action: argparse.Action) -> bool:
    """Whether ``action`` is the one ``parser.add_subparsers()`` made (its ``choices`` map
    each sub-command to its parser).

    Private: ``argparse._SubParsersAction``, the only way to tell that action from the
    others. Checked: Python 3.10-3.13.
    """
    return isinstance(action, argparse._SubParsersAction)
