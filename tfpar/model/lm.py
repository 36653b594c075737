"""The Keras 3 RNN language model.

``inputs`` [B, T] int32 → embedding (``mask_zero``) → ``layers`` × LSTM/GRU → dense
softmax logits [B, T, V] (:meth:`RNNLanguageModel.features` stops before the softmax,
for the sampled loss), with dropout (per token or locked) on the embedding output,
between layers and before the softmax, word-type dropout on the embedding and weight
drop on the recurrent matrices, all drawn by ``tfpar.model.noise``. Every part has its
own layer name (``embedding``, ``rnn_0`` … ``rnn_{L-1}``, ``softmax``) so the pipeline
strategy can place parts on devices by name. The call also takes and returns the recurrent state, so stream mode can
carry it across windows and generation can feed one token at a time.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tfpar.config import ModelConfig
from tfpar.model import cells
from tfpar.model.init import ForgetGateBias, initializer
from tfpar.model.layers import FastGRU, FastLSTM
from tfpar.model.noise import Noise, global_rows
from tfpar.model.precision import dtype_policy, matmul_dtype as precision_matmul_dtype

EMBEDDING, SOFTMAX = "embedding", "softmax"


def rnn_name(i: int) -> str:
    return f"rnn_{i}"


class OutputLayer(NamedTuple):
    """The softmax's matrix and bias: ``logits = h @ kernel + bias`` (``h @ kernel^T``
    when ``vocab_major``), products in ``matmul_dtype`` (None: float32)."""

    kernel: Any  # [D, V] variable (a Dense kernel), or [V, D] when vocab_major
    bias: Any  # [V] variable
    vocab_major: bool
    matmul_dtype: str | None


class RNNLanguageModel(keras.Model):
    """Embedding → stacked RNN → softmax; see the module docstring."""

    def __init__(self, config: ModelConfig, vocab_size: int, *, seed: int = 0,
                 fixed_shapes: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self.vocab_size = vocab_size
        # False when batch shapes vary (sentence mode): the traced graph then never
        # specialises on a batch's shape (see embed), so every batch runs the same kernels
        # whichever shape a step function happened to be traced with first.
        self.fixed_shapes = fixed_shapes
        # Each weight its own stream, keyed by (seed, role) (tfpar.model.init).
        def init(role, default="glorot_uniform"):
            return initializer(role, seed=seed, scale=config.init_scale, default=default)
        # --precision (tfpar.model.precision): a mixed policy gives the embedding and the
        # RNN layers 16-bit tensors (cuDNN computes float16 in 16 bits, but its bfloat16
        # kernel in float32 inside); the softmax layer stays float32 with 16-bit matmul
        # inputs, as do every layer's large matmuls with "bf16".
        policy = dtype_policy(config.precision)
        mixed = {"dtype": policy} if policy is not None else {}
        matmul_dtype = precision_matmul_dtype(config.precision)
        embedding_cls = RowEmbedding if config.softmax == "sampled" else keras.layers.Embedding
        self.embedding = embedding_cls(
            vocab_size, config.embed_dim, mask_zero=True, name=EMBEDDING,
            embeddings_initializer=init(EMBEDDING, "uniform"), **mixed,
        )
        # Keras' LSTM/GRU with a faster recurrence on CPUs (same weights and math; see
        # tfpar.model.layers); a cell of one's own in Keras' loop (tfpar.model.cells).
        rnn_cls = FastLSTM if config.cell == "lstm" else FastGRU
        # [w_0, w_1, ...]: each layer's state tensors are [B, w_k] (a tuple: Keras would
        # track a list).
        user_cells = [cells.make_cell(config.cell, config.hidden_dim)
                      for _ in range(config.layers)] if config.custom_cell else []
        self.state_widths = tuple(
            cells.state_widths(config.cell, user_cells[0]) if user_cells
            else [config.hidden_dim] * (2 if config.cell == "lstm" else 1))
        # Each layer is its own attribute, not a list element: Keras 3 keeps lists in
        # its own tracked collections, which tf.train.Checkpoint does not see, so layers
        # held only in a list would silently be left out of every checkpoint.
        # An LSTM's bias starts at zero but for its forget gate's (--forget-bias), in
        # place of Keras' unit_forget_bias (1.0).
        gate_bias = ({"unit_forget_bias": False,
                      "bias_initializer": ForgetGateBias(config.initial_forget_bias)}
                     if config.cell == "lstm" else {})
        for i in range(config.layers):
            name = rnn_name(i)
            if config.custom_cell:
                setattr(self, name, cells.CellRNN(
                    user_cells[i], seed=seed,
                    return_sequences=True, return_state=True, name=name))
                continue
            setattr(self, name, rnn_cls(
                config.hidden_dim, return_sequences=True, return_state=True, name=name,
                matmul_dtype=None if policy is not None else matmul_dtype, **mixed,
                kernel_initializer=init(f"{name}/kernel"),
                recurrent_initializer=init(f"{name}/recurrent_kernel", "orthogonal"),
                **gate_bias,
            ))
        # Every random mask: a function of (seed, step, site, global row), not of the
        # device (tfpar.model.noise).
        self.noise = Noise(seed)
        if config.weight_drop:
            for i, rnn in enumerate(self.rnns):
                rnn.recurrent_noise = self._weight_drop(i)
        if config.tie_embeddings:
            self.softmax = TiedSoftmax(self.embedding, matmul_dtype=matmul_dtype, name=SOFTMAX,
                                       projection_initializer=init(f"{SOFTMAX}/projection"))
        elif config.softmax == "sampled":
            self.softmax = RowSoftmax(vocab_size, matmul_dtype=matmul_dtype, name=SOFTMAX,
                                      kernel_initializer=init(f"{SOFTMAX}/kernel"))
        else:
            self.softmax = (LowPrecisionDense if matmul_dtype else keras.layers.Dense)(
                vocab_size, name=SOFTMAX, **({"matmul_dtype": matmul_dtype} if matmul_dtype
                                             else {}),
                kernel_initializer=init(f"{SOFTMAX}/kernel"),
            )

    @property
    def rnns(self) -> list:
        return [getattr(self, rnn_name(i)) for i in range(self.config.layers)]

    def _weight_drop(self, i: int):
        site = self.config.layers + 2 + i

        def drop(recurrent_kernel):
            mask = self.noise.shared(tf.shape(recurrent_kernel), self.config.weight_drop, site)
            return recurrent_kernel * tf.cast(mask, recurrent_kernel.dtype)
        return drop

    def _dropout(self, x, i: int, rows, training):
        """Dropout site ``i`` (0: embedding output, i: after layer i) on [B, T, D] ``x``."""
        site = "input" if i == 0 else "output" if i == self.config.layers else "hidden"
        rate = self.config.dropout_at(site)
        if not (training and rate):
            return x
        return self.noise.per_row(x, rate, i, global_rows(tf.shape(x)[0], rows),
                                  locked=self.config.locked_dropout)

    @property
    def state_size(self) -> int:
        """Tensors of state per layer: 2 for LSTM (h, c), 1 for GRU, a custom cell's
        ``len(state_widths)``."""
        return len(self.state_widths)

    def zero_state(self, rows: int):
        """The state ``initial_state=None`` stands for, as tensors: one list per layer of
        ``state_size`` float32 [rows, width] zeros."""
        return [[tf.zeros([rows, width]) for width in self.state_widths]
                for _ in self.rnns]

    def embed(self, inputs, training=False, rows=None):
        """[B, T] ids → ([B, T, E] vectors, [B, T] bool mask).

        ``rows``: [B] int32, the rows' indices in the global batch (None: 0..B-1); they
        key the dropout masks (tfpar.model.noise)."""
        if not self.fixed_shapes and not tf.executing_eagerly():
            # Forget the static [B, T] of the batch this graph is traced with. With
            # reduce_retracing a step function's first trace has exact shapes and later
            # ones do not, and fixed shapes select XLA kernels (tfpar.model.xla) that round
            # differently in the last bits: which batches ran which kernels would depend
            # on where a run started, and a resumed run would not repeat an
            # uninterrupted one exactly.
            inputs = tf.raw_ops.PlaceholderWithDefault(input=inputs, shape=[None, None])
        x = self.embedding(inputs)
        if training and self.config.embed_dropout:
            # Word-type dropout: word w's vector is dropped wherever w occurs this step.
            keep = self.noise.shared([self.vocab_size], self.config.embed_dropout,
                                     self.config.layers + 1)
            x = x * tf.gather(keep, inputs)[..., None]
        return self._dropout(x, 0, rows, training), tf.not_equal(inputs, 0)

    def run_rnn(self, i: int, x, mask, state=None, training=False, rows=None):
        """Layer ``i``: [B, T, D] → ([B, T, H], its final state as a list)."""
        out = self.rnns[i](x, mask=mask, initial_state=state, training=training)
        if out[0].shape[-1] != self.config.hidden_dim:  # a custom cell's output_size lied
            raise cells.output_width_error(self.config.cell, out[0].shape[-1],
                                           self.config.hidden_dim)
        # The state leaves in float32 whatever the layer computes in (a mixed policy): the
        # state carried between stream windows, checkpointed and exported is float32.
        seq, final = out[0], [tf.cast(s, tf.float32) for s in out[1:]]
        return self._dropout(seq, i + 1, rows, training), final

    def call(self, inputs, initial_state=None, training=False, rows=None):
        """Runs the model.

        Args:
          inputs: [B, T] int token ids, 0 = padding (right-padded).
          initial_state: None (zeros) or a list with one entry per layer, each a list of
            [B, H] tensors (``state_size`` of them).
          training: enables dropout.
          rows: [B] int32, the rows' indices in the global batch (None: 0..B-1).

        Returns:
          ``(logits [B, T, V], final_state)`` with ``final_state`` shaped like
          ``initial_state``.
        """
        x, finals = self.features(inputs, initial_state, training=training, rows=rows)
        return self.softmax(x), finals

    def output_layer(self) -> OutputLayer:
        """The softmax layer's weights, as the fused loss (``tfpar.objective.fused``)
        reads them with :meth:`softmax_input`'s output."""
        dtype = getattr(self.softmax, "matmul_dtype", None)
        if hasattr(self.softmax, "output_weights"):  # tied, or one row per word
            kernel, bias = self.softmax.output_weights()
            return OutputLayer(kernel, bias, vocab_major=True, matmul_dtype=dtype)
        return OutputLayer(self.softmax.kernel, self.softmax.bias, vocab_major=False,
                           matmul_dtype=dtype)

    def softmax_input(self, x):
        """[.., H] features → [.., D] what the softmax's matrix multiplies (the tied
        projection applied when there is one)."""
        project = getattr(self.softmax, "project", None)
        return x if project is None else project(x)

    def features(self, inputs, initial_state=None, training=False, rows=None):
        """The model up to the softmax: ``(x [B, T, H], final_state)``, arguments as
        :meth:`call`. ``self.softmax(x)`` is the logits; the sampled loss takes
        ``self.softmax.project(x)`` [B, T, D] and ``self.softmax.output_weights()``."""
        x, mask = self.embed(inputs, training=training, rows=rows)
        finals = []
        for i in range(len(self.rnns)):
            x, final = self.run_rnn(
                i, x, mask, None if initial_state is None else initial_state[i], training,
                rows=rows,
            )
            finals.append(final)
        return x, finals


class RowEmbedding(keras.layers.Embedding):
    """``keras.layers.Embedding`` (same weights) whose lookup reads only the rows it
    gathers (``ResourceGather``), for the sampled softmax's sparse updates. Keras'
    lookup reads the whole table first; with that read still referenced when the
    optimizer scatters the step's rows into the table, TensorFlow copies the entire
    table before writing (copy-on-write): 300 ms of CPU a step for a 793,471 x 200 table,
    more than the rest of the step (tfpar/docs/models.md, "Huge vocabularies")."""

    def call(self, inputs):
        if inputs.dtype not in (tf.int32, tf.int64):
            inputs = tf.cast(inputs, tf.int32)
        table = getattr(self.embeddings, "value", self.embeddings)  # the tf.Variable
        return tf.cast(tf.nn.embedding_lookup(table, inputs), self.compute_dtype)


class TiedSoftmax(keras.layers.Layer):
    """Logits ``h @ E^T + b`` that reuse the embedding matrix ``E`` [V, E] (Press & Wolf,
    2017; Inan et al., 2017). When the RNN's width H differs from E, ``h`` [.., H] is first
    projected to E by a learned ``projection`` [H, E] (no bias), so a wide RNN can keep a
    narrow tied table."""

    def __init__(self, embedding: keras.layers.Embedding, *, matmul_dtype=None,
                 projection_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self._embedding = embedding
        self.matmul_dtype = matmul_dtype
        self.projection_initializer = projection_initializer
        self.projection = None
        self.supports_masking = True

    def build(self, input_shape):
        width = int(input_shape[-1])
        if width != self._embedding.output_dim:
            self.projection = self.add_weight(
                shape=(width, self._embedding.output_dim), name="projection",
                initializer=self.projection_initializer)
        self.bias = self.add_weight(
            shape=(self._embedding.input_dim,), initializer="zeros", name="bias"
        )

    def project(self, x):
        """[.., H] → [.., E]: the tied table's width (the identity when H == E)."""
        if self.projection is not None:
            x = _matmul(x, self.projection, self.matmul_dtype)
        return x

    def output_weights(self):
        """``(E [V, E], bias [V])``: one row per word (the sampled loss reads rows)."""
        return self._embedding.embeddings, self.bias

    def call(self, x):
        x = self.project(x)
        return _matmul(x, self._embedding.embeddings, self.matmul_dtype, transpose_b=True) \
            + self.bias


class RowSoftmax(keras.layers.Layer):
    """Logits ``h @ W^T + b`` with ``W`` [V, H] stored one row per word: the untied
    softmax of a model trained with the sampled softmax, whose gradient then touches only
    the rows of the step's targets and candidates (a Keras ``Dense`` kernel is [H, V],
    whose column gathers differentiate densely)."""

    def __init__(self, units: int, *, matmul_dtype=None, kernel_initializer="glorot_uniform",
                 **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.matmul_dtype = matmul_dtype
        self.kernel_initializer = kernel_initializer
        self.supports_masking = True

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(self.units, int(input_shape[-1])), name="kernel",
                                      initializer=self.kernel_initializer)
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

    def project(self, x):
        return x

    def output_weights(self):
        """``(W [V, H], bias [V])``."""
        return self.kernel, self.bias

    def call(self, x):
        return _matmul(x, self.kernel, self.matmul_dtype, transpose_b=True) + self.bias


class LowPrecisionDense(keras.layers.Dense):
    """``keras.layers.Dense`` (same weights) whose matmul runs in ``matmul_dtype``
    (bfloat16 or float16): inputs and kernel are cast for the product only, the result,
    bias and gradients' consumers stay float32 (``--precision bf16`` and the mixed
    policies' softmax)."""

    def __init__(self, units, *, matmul_dtype="bfloat16", **kwargs):
        super().__init__(units, **kwargs)
        self.matmul_dtype = matmul_dtype

    def call(self, inputs):
        return _matmul(inputs, self.kernel, self.matmul_dtype) + self.bias

    def get_config(self):
        return {**super().get_config(), "matmul_dtype": self.matmul_dtype}


def _matmul(x, w, dtype=None, *, transpose_b=False):
    """[..., K] @ [K, N] (or [N, K] with ``transpose_b``), optionally computed in ``dtype``."""
    w = tf.convert_to_tensor(w)
    out_dtype = x.dtype
    if dtype:
        x, w = tf.cast(x, dtype), tf.cast(w, dtype)
    flat = tf.reshape(x, [-1, tf.shape(x)[-1]])
    y = tf.matmul(flat, w, transpose_b=transpose_b)
    shape = tf.concat([tf.shape(x)[:-1], tf.shape(y)[-1:]], axis=0)
    return tf.cast(tf.reshape(y, shape), out_dtype)


def build_model(config: ModelConfig, vocab_size: int, *, seed: int = 0,
                fixed_shapes: bool = True) -> RNNLanguageModel:
    """Creates the model and its variables (call inside the strategy's scope).

    ``fixed_shapes``: False when batch shapes vary from batch to batch (sentence mode).
    """
    keras.utils.set_random_seed(seed)
    model = RNNLanguageModel(config, vocab_size, seed=seed, fixed_shapes=fixed_shapes,
                             name="rnn_lm")
    model(tf.zeros([1, 1], tf.int32))
    return model


def detached_copy(config: ModelConfig, vocab_size: int, *, seed: int = 0,
                  fixed_shapes: bool = True) -> RNNLanguageModel:
    """The architecture again, with its own variables (call outside any strategy scope),
    without touching the global seeds training relies on (``build_model`` would reset
    them): only Python's ``random`` is drawn from, for Keras's default initializers, and
    it is restored. For copies that evaluate, inspect or export a trained model."""
    state = random.getstate()
    try:
        model = RNNLanguageModel(config, vocab_size, seed=seed, fixed_shapes=fixed_shapes,
                                 name="rnn_lm")
        model(tf.zeros([1, 1], tf.int32))
    finally:
        random.setstate(state)
    return model

