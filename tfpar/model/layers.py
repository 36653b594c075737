"""Fast LSTM and GRU layers: Keras' layers with a leaner recurrence on CPUs, cuDNN on GPUs.

On a host without a GPU, Keras 3's ``LSTM``/``GRU`` run a generic ``tf.while_loop`` whose
body calls the cell: every time step multiplies the step's input by the input kernel,
and its gradient adds one ``[D, 4H]`` kernel gradient per step. :class:`FastLSTM` and
:class:`FastGRU` are the same Keras layers (same weights, variable names, initializers,
masking, states and config) with only the inner loop replaced:

1. the input projection of every time step is one large matmul before the loop::

       XW [T, B, G] = X [T, B, D] @ W [D, G] + b            (G = 4H LSTM, 3H GRU)

2. the loop runs only ``h @ U`` and the gate arithmetic;
3. its gradient is written by hand (back-propagation through time): the loop going
   backwards only produces each step's gate gradients ``dZ_t`` and ``dh_{t-1} = dZ_t @ U^T``;
   the weight gradients come after it as two large matmuls, ``dU = H_prev^T dZ`` and
   ``dW = X^T dZ`` (autodiff through step 1).

With the PTB "small" sizes (batch 20, 35 steps, 200 units, 2 layers) forward + backward
of the stack takes 42 ms instead of Keras' 75 ms. Most of what is left is TF's per-op
overhead inside the loops (~14 small ops per time step), so when a step is traced with a
fixed shape (stream mode) the loops are XLA-compiled (:mod:`tfpar.model.xla`): 33 ms, one
compilation; with varying shapes (sentence buckets) they stay plain ``tf.while_loop``s,
never compiled per bucket. Anything the fast path does not cover (recurrent dropout, other
activations, ``go_backwards``, ``unroll``, no bias, GRU ``reset_after=False``) falls back
to Keras' own loop, so the layers are drop-in replacements.

Masking follows Keras exactly: at a masked step the state is carried unchanged and the
output repeats the previous output (zeros before the first unmasked step).

**On a GPU** the covered layers take Keras' own cuDNN path instead (``CudnnRNNV3``
through ``keras``' TensorFlow backend ``lstm``/``gru``, what ``keras.layers.LSTM`` calls
with ``use_cudnn="auto"``): one fused kernel for the whole sequence, several times faster
than any while-loop recurrence on a GPU. Where the layer runs decides (:func:`runs_on_gpu`:
the device its ops are placed on, so a tower pinned to ``/cpu:0`` on a GPU host keeps the
fast CPU recurrence); the SavedModel export traces the fast recurrence on every device
(:func:`portable_recurrence`: cuDNN's op has no CPU kernel). Weight drop passes the
dropped recurrent matrix, stream mode's carried state goes in as the initial state, and
a sentence batch's mask is right-padded (cuDNN's rule); a row with no token at all (an empty shard's padding) has its first step
unmasked for cuDNN, which refuses an empty sequence: its outputs are padding positions,
which the loss weighs 0. At padding positions cuDNN outputs zeros where Keras repeats
the previous output; the loss over real tokens is the same. When Keras' backend declines
(no cuDNN kernel registered, e.g. a CPU-only build) the fast recurrence runs.

``matmul_dtype="bfloat16"`` runs the two large matmuls (input projection and weight
gradients) in bfloat16 with float32 accumulation and float32 state; it pays off on CPUs
with AMX/AVX512-BF16 and changes results at the ~1e-2 relative level.
"""

from __future__ import annotations

import contextlib
import contextvars

import keras
import tensorflow as tf

from tfpar import compat
from tfpar.model.xla import when_shapes_fixed

# ----------------------------------------------------------------------------- helpers
def _time_major_mask(mask, dtype) -> tf.Tensor | None:
    """[B, T] bool mask → [T, B, 1] float (1 = real step), or None."""
    if mask is None:
        return None
    return tf.cast(tf.transpose(mask)[:, :, None], dtype)


def _project(x, kernel, bias, matmul_dtype):
    """[B, T, D] @ [D, G] + [G] → time-major [T, B, G], one matmul for every step."""
    xt = tf.transpose(x, [1, 0, 2])
    shape = tf.shape(xt)
    flat = tf.reshape(xt, [-1, shape[2]])
    if matmul_dtype is not None:
        xw = tf.cast(tf.matmul(tf.cast(flat, matmul_dtype), tf.cast(kernel, matmul_dtype)),
                     x.dtype)
    else:
        xw = tf.matmul(flat, kernel)
    if bias is not None:
        xw = xw + bias
    return tf.reshape(xw, [shape[0], shape[1], -1])


def _outputs(hs, m):
    """Carried states [T, B, H] → Keras' outputs [B, T, H].

    Where a row has had no real step yet, Keras outputs zeros (its previous output
    starts at zero); everywhere else the carried state is the previous output.
    """
    if m is not None:
        seen = tf.math.cumsum(m, axis=0) > 0
        hs = tf.where(seen, hs, tf.zeros_like(hs))
    return tf.transpose(hs, [1, 0, 2])


def _weight_grad(prev, dz, matmul_dtype):
    """Σ_t prev_t^T dz_t as one matmul: [T, B, H], [T, B, G] → [H, G]."""
    a = tf.reshape(prev, [-1, tf.shape(prev)[-1]])
    b = tf.reshape(dz, [-1, tf.shape(dz)[-1]])
    if matmul_dtype is not None:
        return tf.cast(tf.matmul(tf.cast(a, matmul_dtype), tf.cast(b, matmul_dtype),
                                 transpose_a=True), prev.dtype)
    return tf.matmul(a, b, transpose_a=True)


def _steps(x):
    """The number of time steps of time-major ``x``: a Python int when the shape is known
    (so stacked results keep a static shape), else a tensor."""
    return x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]


def _array(n, dtype, element_shape):
    return tf.TensorArray(dtype, size=n, element_shape=tf.TensorShape(element_shape))


# ----------------------------------------------------------------------------- LSTM
@when_shapes_fixed
def _lstm_forward(xw, h0, c0, m, u):
    """The LSTM recurrence over precomputed input projections.

    Args:
      xw: [T, B, 4H] input projections incl. bias (Keras gate order i, f, c, o).
      h0, c0: [B, H] initial state.
      m: [T, B, 1] float mask or None.
      u: [H, 4H] recurrent kernel.

    Returns:
      ``(hs, cs, acts)``: carried h and c per step, [T, B, H] each, and the activated
      gates [T, B, 4H] (kept for the backward pass).
    """
    n = _steps(xw)
    units = tf.shape(h0)[1]

    def body(t, h, c, hs, cs, acts):
        z = xw[t] + tf.matmul(h, u)
        sig = tf.sigmoid(z)
        i, f, o = sig[:, :units], sig[:, units:2 * units], sig[:, 3 * units:]
        g = tf.tanh(z[:, 2 * units:3 * units])
        c_new = f * c + i * g
        h_new = o * tf.tanh(c_new)
        if m is not None:
            h_new = h + m[t] * (h_new - h)
            c_new = c + m[t] * (c_new - c)
        act = tf.concat([i, f, g, o], axis=1)
        return t + 1, h_new, c_new, hs.write(t, h_new), cs.write(t, c_new), acts.write(t, act)

    _, _, _, hs, cs, acts = tf.while_loop(
        lambda t, *_: t < n, body,
        (0, h0, c0, _array(n, xw.dtype, h0.shape), _array(n, xw.dtype, h0.shape),
         _array(n, xw.dtype, xw.shape[1:])),
    )
    return hs.stack(), cs.stack(), acts.stack()


@when_shapes_fixed
def _lstm_backward(dhs, dc_last, cs, c0, acts, m, u):
    """Back-propagation through the LSTM recurrence.

    Args:
      dhs: [T, B, H] gradient w.r.t. the carried h of every step.
      dc_last: [B, H] gradient w.r.t. the final c.
      cs, c0, acts, m, u: as saved by :func:`_lstm_forward`.

    Returns:
      ``(dz, dh0, dc0)``: the gate pre-activation gradients [T, B, 4H] (= the gradient of
      ``xw``) and the gradients of the initial state.
    """
    n = _steps(dhs)
    units = tf.shape(c0)[1]
    ut = tf.transpose(u)
    cs_prev = tf.concat([c0[None], cs[:-1]], axis=0)

    def body(t, dh, dc, dz_arr):
        dh = dh + dhs[t]
        c, c_prev = cs[t], cs_prev[t]
        act = acts[t]
        i, f, g, o = (act[:, :units], act[:, units:2 * units], act[:, 2 * units:3 * units],
                      act[:, 3 * units:])
        if m is not None:
            keep = 1.0 - m[t]
            dh_cell, dc_cell = dh * m[t], dc * m[t]
        else:
            dh_cell, dc_cell = dh, dc
        tc = tf.tanh(c)
        dcc = dc_cell + dh_cell * o * (1.0 - tc * tc)
        dz = tf.concat([
            dcc * g * i * (1.0 - i),
            dcc * c_prev * f * (1.0 - f),
            dcc * i * (1.0 - g * g),
            dh_cell * tc * o * (1.0 - o),
        ], axis=1)
        dh_prev = tf.matmul(dz, ut)
        dc_prev = dcc * f
        if m is not None:
            dh_prev += keep * dh
            dc_prev += keep * dc
        return t - 1, dh_prev, dc_prev, dz_arr.write(t, dz)

    _, dh0, dc0, dz = tf.while_loop(
        lambda t, *_: t >= 0, body,
        (n - 1, tf.zeros_like(c0), dc_last, _array(n, dhs.dtype, acts.shape[1:])),
    )
    return dz.stack(), dh0, dc0


def lstm_sequence(x, h0, c0, mask, kernel, recurrent_kernel, bias, *, matmul_dtype=None):
    """Runs an LSTM over a batch of sequences (Keras' math and gate order).

    Args:
      x: [B, T, D] inputs.
      h0, c0: [B, H] initial state.
      mask: [B, T] bool (True = real step) or None.
      kernel: [D, 4H]; recurrent_kernel: [H, 4H]; bias: [4H] or None.
      matmul_dtype: None, or tf.bfloat16 for the large matmuls.

    Returns:
      ``(outputs [B, T, H], h [B, H], c [B, H])``.
    """
    m = _time_major_mask(mask, x.dtype)
    xw = _project(x, kernel, bias, matmul_dtype)

    @tf.custom_gradient
    def recurrence(xw, h0, c0, u):
        hs, cs, acts = _lstm_forward(xw, h0, c0, m, u)

        def grad(dhs, dc_last):
            dz, dh0, dc0 = _lstm_backward(dhs, dc_last, cs, c0, acts, m, u)
            h_prev = tf.concat([h0[None], hs[:-1]], axis=0)
            return dz, dh0, dc0, _weight_grad(h_prev, dz, matmul_dtype)

        return (hs, cs[-1]), grad

    hs, c = recurrence(xw, h0, c0, recurrent_kernel)
    return _outputs(hs, m), hs[-1], c


# ----------------------------------------------------------------------------- GRU
@when_shapes_fixed
def _gru_forward(xw, h0, m, u, b_rec):
    """The GRU recurrence (``reset_after=True``, Keras gate order z, r, h).

    Args:
      xw: [T, B, 3H] input projections incl. the input bias.
      h0: [B, H]; m: [T, B, 1] float mask or None.
      u: [H, 3H] recurrent kernel; b_rec: [3H] recurrent bias.

    Returns:
      ``(hs, saved)``: the carried h [T, B, H] and, per step, [z, r, hh, rec_h] [T, B, 4H]
      for the backward pass.
    """
    n = _steps(xw)
    units = tf.shape(h0)[1]
    saved_shape = [h0.shape[0], None if h0.shape[1] is None else 4 * h0.shape[1]]

    def body(t, h, hs, saved):
        x = xw[t]
        rec = tf.matmul(h, u) + b_rec
        zr = tf.sigmoid(x[:, :2 * units] + rec[:, :2 * units])
        z, r = zr[:, :units], zr[:, units:]
        rec_h = rec[:, 2 * units:]
        hh = tf.tanh(x[:, 2 * units:] + r * rec_h)
        h_new = hh + z * (h - hh)
        if m is not None:
            h_new = h + m[t] * (h_new - h)
        return t + 1, h_new, hs.write(t, h_new), saved.write(t, tf.concat([zr, hh, rec_h], 1))

    _, _, hs, saved = tf.while_loop(
        lambda t, *_: t < n, body,
        (0, h0, _array(n, xw.dtype, h0.shape), _array(n, xw.dtype, saved_shape)))
    return hs.stack(), saved.stack()


@when_shapes_fixed
def _gru_backward(dhs, hs, h0, saved, m, u):
    """Back-propagation through the GRU recurrence.

    Returns:
      ``(dxw, drec, dh0)``: gradients of the input projections [T, B, 3H], of the
      recurrent pre-activations ``h @ U + b_rec`` [T, B, 3H], and of ``h0``.
    """
    n = _steps(dhs)
    units = tf.shape(h0)[1]
    gates = [dhs.shape[1], u.shape[1]]
    ut = tf.transpose(u)
    hs_prev = tf.concat([h0[None], hs[:-1]], axis=0)

    def body(t, dh, dx_arr, drec_arr):
        dh = dh + dhs[t]
        h_prev = hs_prev[t]
        s = saved[t]
        z, r = s[:, :units], s[:, units:2 * units]
        hh, rec_h = s[:, 2 * units:3 * units], s[:, 3 * units:]
        dh_cell = dh * m[t] if m is not None else dh
        dah = dh_cell * (1.0 - z) * (1.0 - hh * hh)
        daz = dh_cell * (h_prev - hh) * z * (1.0 - z)
        dar = dah * rec_h * r * (1.0 - r)
        dx = tf.concat([daz, dar, dah], axis=1)
        drec = tf.concat([daz, dar, dah * r], axis=1)
        dh_prev = tf.matmul(drec, ut) + dh_cell * z
        if m is not None:
            dh_prev += (1.0 - m[t]) * dh
        return t - 1, dh_prev, dx_arr.write(t, dx), drec_arr.write(t, drec)

    _, dh0, dx, drec = tf.while_loop(
        lambda t, *_: t >= 0, body,
        (n - 1, tf.zeros_like(h0), _array(n, dhs.dtype, gates), _array(n, dhs.dtype, gates)),
    )
    return dx.stack(), drec.stack(), dh0


def gru_sequence(x, h0, mask, kernel, recurrent_kernel, bias, *, matmul_dtype=None):
    """Runs a GRU (``reset_after=True``) over a batch of sequences.

    Args:
      x: [B, T, D]; h0: [B, H]; mask: [B, T] bool or None.
      kernel: [D, 3H]; recurrent_kernel: [H, 3H]; bias: [2, 3H] (input, recurrent).
      matmul_dtype: None, or tf.bfloat16 for the large matmuls.

    Returns:
      ``(outputs [B, T, H], h [B, H])``.
    """
    m = _time_major_mask(mask, x.dtype)
    xw = _project(x, kernel, bias[0], matmul_dtype)

    @tf.custom_gradient
    def recurrence(xw, h0, u, b_rec):
        hs, saved = _gru_forward(xw, h0, m, u, b_rec)

        def grad(dhs):
            dx, drec, dh0 = _gru_backward(dhs, hs, h0, saved, m, u)
            h_prev = tf.concat([h0[None], hs[:-1]], axis=0)
            db = tf.reduce_sum(drec, axis=[0, 1])
            return dx, dh0, _weight_grad(h_prev, drec, matmul_dtype), db

        return hs, grad

    hs = recurrence(xw, h0, recurrent_kernel, bias[1])
    return _outputs(hs, m), hs[-1]


# ----------------------------------------------------------------------------- layers
def _value(v):
    """A weight as a plain tensor: custom gradients must not see (distributed) variables;
    the read itself is what the tape differentiates. tf.identity puts a copy on the device
    that runs the layer (a tower's): TF leaves a variable read without a device, and the
    recurrence loop's plumbing for it would then land on device 0 and feed every step from
    there."""
    return tf.identity(tf.convert_to_tensor(v.value if hasattr(v, "value") else v))


def _default_math(layer) -> bool:
    cell = layer.cell
    return (
        cell.activation is keras.activations.tanh
        and cell.recurrent_activation is keras.activations.sigmoid
        and cell.use_bias and not cell.recurrent_dropout
        and not layer.go_backwards and not layer.unroll
    )


def _dropped(layer, sequences, training):
    """Input dropout as Keras' cuDNN path applies it (one mask for every step)."""
    if not (training and layer.cell.dropout):
        return sequences
    mask = layer.cell.get_dropout_mask(sequences[:, 0, :])
    return sequences * mask[:, None, :]


# True inside portable_recurrence(): no layer traces the cuDNN op, whatever its device.
_PORTABLE = contextvars.ContextVar("tfpar_portable_recurrence", default=False)


@contextlib.contextmanager
def portable_recurrence():
    """Layers traced inside the block take the fast recurrence on every device.

    ``CudnnRNNV3`` has GPU kernels only: a graph traced with it runs on GPUs and nowhere
    else. The SavedModel export (:mod:`tfpar.serving.export`) traces its signatures in
    here, so a model exported on a GPU host is served on CPUs too (and on GPUs, with the
    while-loop recurrence).
    """
    token = _PORTABLE.set(True)
    try:
        yield
    finally:
        _PORTABLE.reset(token)


def takes_cudnn(probe: tf.Tensor) -> bool:
    """Whether a layer whose weight is ``probe`` traces Keras' cuDNN path: on a GPU
    (:func:`runs_on_gpu`), outside :func:`portable_recurrence`."""
    return not _PORTABLE.get() and runs_on_gpu(probe)


def runs_on_gpu(probe: tf.Tensor) -> bool:
    """Whether the op that produced ``probe`` runs on a GPU: by its device (the placement
    scope while tracing a graph, where it ran when eager), or, with none given, whether
    TensorFlow sees a GPU (its placer then puts the op on GPU 0)."""
    device = probe.device
    if device:
        return tf.DeviceSpec.from_string(device).device_type == "GPU"
    return bool(tf.config.list_logical_devices("GPU"))


def _cudnn_mask(mask):
    """``mask`` [B, T] with every row's first step on: cuDNN refuses a row of length 0."""
    if mask is None:
        return None
    mask = tf.cast(mask, tf.bool)
    return tf.concat([tf.ones_like(mask[:, :1]), mask[:, 1:]], axis=1)


class _FastRecurrence:
    """What FastLSTM and FastGRU share: the ``matmul_dtype`` option, and an ``inner_loop``
    that, when the layer's math is the default one, takes Keras' cuDNN path on a GPU
    (``_cudnn``) and the fast recurrence (``_fast``) elsewhere, and Keras' own loop for
    any other math."""

    def __init__(self, units, *, matmul_dtype: str | None = None, **kwargs):
        super().__init__(units, **kwargs)
        self.matmul_dtype = matmul_dtype
        # Weight drop: maps the recurrent matrix [H, kH] to the one a training step uses
        # (set by the model; None: the matrix itself).
        self.recurrent_noise = None

    def _covered(self) -> bool:
        return _default_math(self)

    def inner_loop(self, sequences, initial_state, mask, training=False):
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        if not self._covered():
            if self.recurrent_noise is not None:
                raise ValueError("weight drop needs the default LSTM/GRU math")
            return super().inner_loop(sequences, initial_state, mask, training=training)
        if not isinstance(initial_state, (list, tuple)):
            initial_state = [initial_state]
        cell = self.cell
        kernel = _value(cell.kernel)
        recurrent_kernel = _value(cell.recurrent_kernel)
        if training and self.recurrent_noise is not None:
            recurrent_kernel = self.recurrent_noise(recurrent_kernel)
        args = (_dropped(self, sequences, training), list(initial_state), mask, kernel,
                recurrent_kernel, _value(cell.bias))
        low = self.compute_dtype if self.compute_dtype != "float32" else None
        if self.matmul_dtype is None and takes_cudnn(kernel):
            try:
                if low is None:
                    return self._cudnn(*args)
                # A mixed policy: cuDNN in the 16-bit type, the final state float32.
                x, state, *rest = args
                last, outputs, final = self._cudnn(
                    x, [tf.cast(s, low) for s in state], *rest)
                return last, outputs, [tf.cast(s, tf.float32) for s in final]
            except NotImplementedError:  # Keras' backend declined: no usable cuDNN here
                pass
        if low is None:
            return self._fast(*args)
        # A mixed policy on the fast recurrence: state and gate arithmetic in float32, the
        # large matmuls in the 16-bit type, the outputs in it.
        x, state, mask, *weights = args
        last, outputs, final = self._fast(
            tf.cast(x, tf.float32), [tf.cast(s, tf.float32) for s in state], mask,
            *[tf.cast(w, tf.float32) for w in weights], matmul_dtype=low)
        return tf.cast(last, low), tf.cast(outputs, low), final

    def get_config(self):
        return {**super().get_config(), "matmul_dtype": self.matmul_dtype}


class FastLSTM(_FastRecurrence, keras.layers.LSTM):
    """``keras.layers.LSTM`` with the recurrence of :func:`lstm_sequence`.

    Args:
      matmul_dtype: None (float32) or "bfloat16" for the large matmuls.
      Everything else: as ``keras.layers.LSTM``.
    """

    def _fast(self, x, state, mask, kernel, recurrent_kernel, bias, matmul_dtype=None):
        outputs, h, c = lstm_sequence(x, state[0], state[1], mask, kernel, recurrent_kernel,
                                      bias, matmul_dtype=matmul_dtype or self.matmul_dtype)
        return h, outputs, [h, c]

    def _cudnn(self, x, state, mask, kernel, recurrent_kernel, bias):
        cell = self.cell
        return compat.keras_tf_rnn().lstm(
            x, state[0], state[1], _cudnn_mask(mask), kernel=kernel,
            recurrent_kernel=recurrent_kernel, bias=bias, activation=cell.activation,
            recurrent_activation=cell.recurrent_activation,
            return_sequences=self.return_sequences)


class FastGRU(_FastRecurrence, keras.layers.GRU):
    """``keras.layers.GRU`` with the recurrence of :func:`gru_sequence`.

    Args:
      matmul_dtype: None (float32) or "bfloat16" for the large matmuls.
      Everything else: as ``keras.layers.GRU``.
    """

    def _covered(self) -> bool:
        return _default_math(self) and self.cell.reset_after

    def _fast(self, x, state, mask, kernel, recurrent_kernel, bias, matmul_dtype=None):
        outputs, h = gru_sequence(x, state[0], mask, kernel, recurrent_kernel, bias,
                                  matmul_dtype=matmul_dtype or self.matmul_dtype)
        return h, outputs, [h]

    def _cudnn(self, x, state, mask, kernel, recurrent_kernel, bias):
        cell = self.cell
        last, outputs, h = compat.keras_tf_rnn().gru(
            x, state[0], _cudnn_mask(mask), kernel=kernel, recurrent_kernel=recurrent_kernel,
            bias=bias, activation=cell.activation,
            recurrent_activation=cell.recurrent_activation,
            return_sequences=self.return_sequences, reset_after=True)
        return last, outputs, h
