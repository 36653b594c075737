"""The full softmax's loss without its logits: the output layer and the cross-entropy fused.

``N`` hidden states ``h`` [N, D] against a ``V``-word output layer make ``[N, V]`` logits:
28 MB at N = 700, V = 10,000; 2.2 GB at V = 793,471. Here they exist one block at a time::

    rows     r: at most ``rows`` of the N tokens, in order
    columns  c: at most ``columns`` of the V words, in order
    block    z = h[r] @ W[:, c] + b[c]                  [R, C] float32

    loss     lse = log sum_c sum_j exp(z_j)   (a running max m and sum s over the
                                               blocks: the online log-sum-exp)
             nll = lse - z[target]            per token
    gradient dz = g * (exp(z - lse) - onehot(target))   of sum_i g_i nll_i, block by block
             dh[r] += dz @ W[:, c]^T;   dW[:, c] += h[r]^T @ dz;   db[c] += sum_rows dz

Training (``gradient_in_forward``) takes the gradient in the loss's pass, so each block's
logits are computed once when a row's words fit one column block (``columns >= V``):
three products, as the unfused path. When every token and word fit one block (the
default blocks at PTB's 700 x 10,000) the pass keeps what the gradient's two products
need, ``[N, V]`` as the unfused path's logits, and they run in the gradient function
(:func:`_one_block`); otherwise the gradient is complete after the loss's pass and the
gradient function only scales it. With several column blocks a row's loss needs every
block before its gradient, so each block's logits are computed twice (four products).
Evaluation only runs the loss's pass.

The blocks run in a fixed order (a ``tf.while_loop`` for the rows and one for the
columns), so a step's result is the same on every run. Each block's elementwise work (the
bias, the log-sum-exp, the gradient of the logits and of the bias) is one XLA-compiled
function when the block's shape is fixed (``tfpar.model.xla``), TensorFlow's ops
otherwise; the products are TensorFlow's matmuls.

Two layouts of the output matrix: a Dense kernel ``W`` [D, V], or ``vocab_major`` [V, D]
(one row per word: the tied embedding, the sampled softmax's table). With a
``matmul_dtype`` (bfloat16 or float16) the products take that type (a float32
accumulation inside the matmul, its result rounded to the type) and everything else stays
float32: the logits, the log-sum-exp, the loss and the gradient of the logits, as in the
unfused ``--precision bf16`` path.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import tensorflow as tf

from tfpar.config import DEFAULT_SOFTMAX_BLOCKS
from tfpar.model.xla import when_shapes_fixed

# --softmax-blocks' defaults (measured; see tfpar.config).
DEFAULT_ROWS, DEFAULT_COLUMNS = DEFAULT_SOFTMAX_BLOCKS


def fused_softmax_nll(h: tf.Tensor, kernel, bias, targets: tf.Tensor,
                      token_weights: tf.Tensor, *, vocab_major: bool = False,
                      matmul_dtype: str | None = None, rows: int = DEFAULT_ROWS,
                      columns: int = DEFAULT_COLUMNS, gradient_in_forward: bool = True
                      ) -> tuple[tf.Tensor, tf.Tensor]:
    """``sum_i w_i * nll_i`` over the output layer's softmax, and ``sum_i w_i``.

    Args:
      h: [N, D] float (or [..., D]), the output layer's inputs (after any tied
        projection).
      kernel: [D, V] float32, or [V, D] with ``vocab_major`` (a variable or a tensor).
      bias: [V] float32.
      targets: [N] int (or [...]), next-token ids.
      token_weights: [N] float32 (or [...]), each token's weight (1 real, 0 padding).
      vocab_major: ``kernel`` holds one row per word.
      matmul_dtype: the products' input type ("bfloat16", "float16"; None: float32).
      rows, columns: the largest block of logits at a time (see the module docstring).
      gradient_in_forward: compute the gradient with the loss, in one pass over the
        logits (training); False: only the loss, the gradient (if one is taken) by
        recomputation (evaluation).

    Returns:
      ``(nll_sum, count)``, float32 scalars; ``nll_sum`` is differentiable in ``h``,
      ``kernel`` and ``bias``.
    """
    with tf.name_scope("fused_softmax_nll"):  # one box in TensorBoard's graph
        h, targets, token_weights = _flat(h, targets, token_weights)
        count = tf.reduce_sum(token_weights)
        if not gradient_in_forward:
            nll = token_nll(h, kernel, bias, targets, vocab_major=vocab_major,
                            matmul_dtype=matmul_dtype, rows=rows, columns=columns)
            return tf.reduce_sum(nll * token_weights), count
        layout = (vocab_major, matmul_dtype)
        kernel, bias = _tensor(kernel), _tensor(bias)

        def one_block():
            return _one_block(h, targets, token_weights, kernel, bias, layout)

        def blocks():
            return _blocks(h, targets, token_weights, kernel, bias, layout, rows=rows,
                           columns=columns)

        if bias.shape[0] > columns:
            return blocks(), count
        n = h.shape[0]
        if n is not None:
            return (one_block() if n <= rows else blocks()), count
        # The trace hides the row count (a strategy's slice of the batch, a batch read inside
        # a multi-step loop): the path follows the count the step runs with.
        return tf.cond(tf.shape(h)[0] <= rows, one_block, blocks), count


def _blocks(h, targets, token_weights, kernel, bias, layout, *, rows: int, columns: int):
    """The loss with its gradient computed in the same pass, block by block."""

    @tf.custom_gradient
    def loss(h, kernel, bias):
        nll, dh, dw, db = _all_rows(h, targets, token_weights, kernel, bias, layout,
                                    rows=rows, columns=columns, gradient=True)

        def grad(dy):
            return dy * dh, dy * dw, dy * db

        return tf.reduce_sum(nll * token_weights), grad

    return loss(h, kernel, bias)


def _one_block(h, targets, token_weights, kernel, bias, layout):
    """The whole [N, V] in one block. The loss pass leaves ``e`` [N, V] (the
    exponentials, each row's sum subtracted at its target; as much as the unfused path's
    logits) and ``c`` [N] (each token's weight over its row's sum), the logits' gradient
    being ``c * e`` row by row; the gradient function's two products take ``e`` as it is
    and the factors ``c`` and the loss's ``dy`` scale their [N, D] inputs and outputs:
    no pass over [N, V] for them.

    With float32 products the bias rides in them as one more input of ones:
    ``[h, 1] @ [W; b]`` and ``[h, 1]^T @ (c e) = [dW; db]`` (transposed for a
    vocab-major kernel), so the elementwise work skips the bias and the bias gradient's
    pass over [N, V]. With 16-bit products the bias stays out of them: its sum and
    gradient stay float32."""
    vocab_major, dtype = layout
    with_ones = dtype is None

    @tf.custom_gradient
    def loss(h, kernel, bias):
        w = _in(kernel, dtype)
        if with_ones:
            h1 = tf.concat([h, tf.ones_like(h[:, :1])], 1)  # [N, D + 1]
            # [W; b] [D + 1, V], or [E, b] [V, D + 1] one row per word
            w1 = tf.concat([kernel, bias[:, None] if vocab_major else bias[None]],
                           1 if vocab_major else 0)
            z = _product(h1, w1, vocab_major)
            nll, e, c = _kernels(dtype).loss_and_grad(z, None, targets, token_weights)
        else:
            z = _product(_in(h, dtype), w, vocab_major)
            nll, e, c, db = _kernels(dtype).loss_and_grad(z, bias, targets, token_weights)

        def grad(dy):
            scale = (c * dy)[:, None]
            dh = scale * _input_grad(e, w, vocab_major)
            if with_ones:
                both = _weight_grad(h1 * scale, e, vocab_major)  # dW and db side by side
                d = tf.shape(h)[1]
                if vocab_major:
                    return dh, both[:, :d], both[:, d]
                return dh, tf.slice(both, [0, 0], [d, -1]), tf.reshape(both[d:], [-1])
            return dh, _weight_grad(_in(h * scale, dtype), e, vocab_major), dy * db

        return tf.reduce_sum(nll * token_weights), grad

    return loss(h, kernel, bias)


def token_nll(h: tf.Tensor, kernel, bias, targets: tf.Tensor, *, vocab_major: bool = False,
              matmul_dtype: str | None = None, rows: int = DEFAULT_ROWS,
              columns: int = DEFAULT_COLUMNS) -> tf.Tensor:
    """Each token's negative log-likelihood, [N] float32 (arguments as
    :func:`fused_softmax_nll`); its gradient recomputes the logits block by block."""
    h, targets, _ = _flat(h, targets, None)
    layout = (vocab_major, matmul_dtype)

    @tf.custom_gradient
    def nll(h, kernel, bias):
        out = _all_rows(h, targets, None, kernel, bias, layout, rows=rows, columns=columns,
                        gradient=False)[0]

        def grad(dy):
            _, dh, dw, db = _all_rows(h, targets, dy, kernel, bias, layout, rows=rows,
                                      columns=columns, gradient=True)
            return dh, dw, db

        return out, grad

    return nll(h, _tensor(kernel), _tensor(bias))


def _flat(h, targets, token_weights):
    """[.., D] → [N, D] float32; [..] → [N] int32 and float32."""
    h = tf.cast(tf.reshape(h, [-1, tf.shape(h)[-1]]), tf.float32)
    targets = tf.reshape(tf.cast(targets, tf.int32), [-1])
    if token_weights is not None:
        token_weights = tf.reshape(tf.cast(token_weights, tf.float32), [-1])
    return h, targets, token_weights


def _tensor(weight):
    """A variable's (a Keras variable's, a replica's copy's) value as a tensor, read under
    the caller's device: a variable read requests no device, and the block loops' inputs
    fed from one ran on the host's first device (a pipeline stage's output layer read
    across devices every evaluation batch; ``tests/test_pipeline.py``)."""
    return tf.identity(tf.convert_to_tensor(weight))


# -- the row blocks
def _all_rows(h, targets, g, kernel, bias, layout, *, rows: int, columns: int,
              gradient: bool):
    """Every row block in order.

    Args:
      h: [N, D] float32; targets: [N] int32; g: [N] float32, the gradient's weight of
        each token's nll (None without the gradient).
      kernel, bias, layout: the output layer (``layout``: (vocab_major, matmul_dtype)).

    Returns:
      ``(nll [N], dh [N, D], dkernel, dbias)`` (the last three None without the gradient).
    """
    n = h.shape[0]
    if n is not None and n <= rows:  # one block: no loop
        return _row_block(h, targets, g, kernel, bias, layout, columns=columns,
                          gradient=gradient)
    n = tf.shape(h)[0]
    blocks = (n + rows - 1) // rows
    size = (n + blocks - 1) // blocks  # equal blocks: at most blocks - 1 rows of padding
    pad = blocks * size - n
    h_rows = tf.reshape(tf.pad(h, [[0, pad], [0, 0]]), [blocks, size, -1])
    y_rows = tf.reshape(tf.pad(targets, [[0, pad]]), [blocks, size])
    # Padding rows weigh 0: their gradient is 0 (their nll is cut off below).
    g_rows = None if g is None else tf.reshape(tf.pad(g, [[0, pad]]), [blocks, size])
    nlls = tf.TensorArray(tf.float32, size=blocks, infer_shape=False)
    dhs = tf.TensorArray(tf.float32, size=blocks if gradient else 0, infer_shape=False)
    zero = tf.zeros([], tf.float32)
    dw0 = tf.zeros_like(kernel, tf.float32) if gradient else zero
    db0 = tf.zeros_like(bias, tf.float32) if gradient else zero

    def body(i, nlls, dhs, dw, db):
        nll, dh, dw_i, db_i = _row_block(h_rows[i], y_rows[i],
                                         None if g is None else g_rows[i], kernel, bias,
                                         layout, columns=columns, gradient=gradient)
        if gradient:
            dhs, dw, db = dhs.write(i, dh), dw + dw_i, db + db_i
        return i + 1, nlls.write(i, nll), dhs, dw, db

    _, nlls, dhs, dw, db = tf.while_loop(
        lambda i, *_: i < blocks, body, (tf.constant(0), nlls, dhs, dw0, db0),
        parallel_iterations=1)
    nll = nlls.concat()[:n]
    if not gradient:
        return nll, None, None, None
    return nll, dhs.concat()[:n], dw, db


# -- one row block: its column blocks
def _row_block(h, y, g, kernel, bias, layout, *, columns: int, gradient: bool):
    """One row block (``h`` [R, D], ``y`` [R], ``g`` [R] or None); returns as
    :func:`_all_rows`, for these rows (``dkernel``, ``dbias``: their share)."""
    vocab_major, dtype = layout
    vocab = bias.shape[0]
    blocks = -(-vocab // columns)
    if blocks == 1:
        w = _in(kernel, dtype)
        z = _product(_in(h, dtype), w, vocab_major)
        if not gradient:
            m, s, zt = _kernels(None).stats(z, bias, y, *_start(y))
            return m + tf.math.log(s) - zt, None, None, None
        nll, e, c, db = _kernels(dtype).loss_and_grad(z, bias, y, g)
        scale = c[:, None]
        return (nll, scale * _input_grad(e, w, vocab_major),
                _weight_grad(_in(h * scale, dtype), e, vocab_major), db)
    h = _in(h, dtype)

    width = -(-vocab // blocks)  # blocks - 1 of this width, then the rest
    last = (blocks - 1) * width
    stats = _kernels(None).stats

    def pass1(c0, size, m, s, zt):
        z = _product(h, _in(_words(kernel, c0, size, vocab_major), dtype), vocab_major)
        return stats(z, _slice(bias, c0, size), y - c0, m, s, zt)

    m, s, zt = tf.while_loop(
        lambda i, *_: i < blocks - 1,
        lambda i, *acc: (i + 1, *pass1(i * width, width, *acc)),
        (tf.constant(0), *_start(y)), parallel_iterations=1)[1:]
    m, s, zt = pass1(last, vocab - last, m, s, zt)
    lse = m + tf.math.log(s)
    nll = lse - zt
    if not gradient:
        return nll, None, None, None
    grad = _kernels(dtype).grad

    def pass2(c0, size, dh):
        w = _in(_words(kernel, c0, size, vocab_major), dtype)
        dz, db = grad(_product(h, w, vocab_major), _slice(bias, c0, size), y - c0, lse, g)
        return (dh + _input_grad(dz, w, vocab_major), _weight_grad(h, dz, vocab_major), db)

    def body(i, dh, dws, dbs):
        dh, dw, db = pass2(i * width, width, dh)
        return i + 1, dh, dws.write(i, dw), dbs.write(i, db)

    dws = tf.TensorArray(tf.float32, size=blocks - 1, infer_shape=False)
    dbs = tf.TensorArray(tf.float32, size=blocks - 1, infer_shape=False)
    dh0 = tf.zeros(tf.shape(h), tf.float32)
    _, dh, dws, dbs = tf.while_loop(lambda i, *_: i < blocks - 1, body,
                                    (tf.constant(0), dh0, dws, dbs), parallel_iterations=1)
    dh, dw_last, db_last = pass2(last, vocab - last, dh)
    if vocab_major:  # [C, D] blocks stack on the word axis
        dw = tf.concat([dws.concat(), dw_last], 0)
    else:  # [D, C] blocks side by side
        stacked = tf.transpose(dws.stack(), [1, 0, 2])  # [D, blocks - 1, C]
        dw = tf.concat([tf.reshape(stacked, [tf.shape(h)[1], -1]), dw_last], 1)
    return nll, dh, dw, tf.concat([dbs.concat(), db_last], 0)


def _start(y):
    """The online log-sum-exp's start: max -inf, sum 0, target logit 0 (each [R])."""
    zeros = tf.zeros(tf.shape(y), tf.float32)
    return zeros - float("inf"), zeros, zeros


def _words(kernel, c0, size: int, vocab_major: bool):
    """The output matrix's words ``c0 .. c0 + size`` ([D, size], or [size, D])."""
    if vocab_major:
        return tf.slice(kernel, tf.stack([c0, 0]), [size, -1])
    return tf.slice(kernel, tf.stack([0, c0]), [-1, size])


def _slice(bias, c0, size: int):
    return tf.slice(bias, tf.reshape(c0, [1]), [size])


def _in(x, dtype):
    """``x`` in the matmul type (unchanged for float32)."""
    return x if dtype is None else tf.cast(x, dtype)


def _product(h, w, vocab_major: bool):
    """The block's logits before the bias: [R, D] x the block's words → [R, C]."""
    return tf.matmul(h, w, transpose_b=vocab_major)


def _input_grad(dz, w, vocab_major: bool):
    """``dz`` [R, C] → its share of dh, [R, D] float32."""
    return tf.cast(tf.matmul(dz, w, transpose_b=not vocab_major), tf.float32)


def _weight_grad(h, dz, vocab_major: bool):
    """The block's kernel gradient: [D, C] (or [C, D] when vocab_major) float32."""
    if vocab_major:
        return tf.cast(tf.matmul(dz, h, transpose_a=True), tf.float32)
    return tf.cast(tf.matmul(h, dz, transpose_a=True), tf.float32)


# -- the elementwise work of a block: one XLA function each when its shape is fixed
class _Kernels(NamedTuple):
    stats: object
    loss_and_grad: object
    grad: object


@functools.lru_cache(maxsize=None)
def _kernels(dtype: str | None) -> _Kernels:
    """The block functions whose ``dz`` comes out in ``dtype`` (None: float32), the
    type the next products take."""
    out = tf.float32 if dtype is None else tf.dtypes.as_dtype(dtype)

    def stats(z, bias, y, m, s, zt):
        """One block folded into the running log-sum-exp: ``z`` [R, C] the product,
        ``bias`` [C], ``y`` [R] the targets counted from the block's first word;
        ``m``, ``s``, ``zt`` [R]: the running max, the sum of ``exp(z - m)`` and the
        target's logit (0 until its block)."""
        z = tf.cast(z, tf.float32) + bias
        m_new = tf.maximum(m, tf.reduce_max(z, 1))
        s = s * tf.exp(m - m_new) + tf.reduce_sum(tf.exp(z - m_new[:, None]), 1)
        width = tf.shape(z)[1]
        here = tf.logical_and(y >= 0, y < width)
        zt = tf.where(here, tf.gather(z, tf.clip_by_value(y, 0, width - 1), batch_dims=1), zt)
        return m_new, s, zt

    def loss_and_grad(z, bias, y, g):
        """A whole row's logits at once (``z`` [R, V], ``bias`` [V] or None when ``z``
        holds it): ``(nll [R], e [R, V], c [R], dbias [V])``, the logits' gradient being
        ``c[:, None] * e``: ``e = exp(z - max)`` with the row's sum ``s`` subtracted at
        its target, ``c = g / s``; in a 16-bit ``out``, ``e / s`` with 1 subtracted and
        ``c = g`` (without ``dbias`` when ``bias`` is None)."""
        z = tf.cast(z, tf.float32)
        if bias is not None:
            z = z + bias
        m = tf.reduce_max(z, 1, keepdims=True)
        e = tf.exp(z - m)
        s = tf.reduce_sum(e, 1)
        nll = m[:, 0] + tf.math.log(s) - tf.gather(z, y, batch_dims=1)
        targets = tf.stack([tf.range(tf.shape(y)[0]), y], 1)
        if out == tf.float32:
            e = tf.tensor_scatter_nd_sub(e, targets, s)
            c = g / s
        else:  # the probabilities (their pass casts anyway): float16 tops out at 65,504
            e = tf.tensor_scatter_nd_sub(e / s[:, None], targets, tf.ones_like(s))
            c = g
        if bias is None:
            return nll, tf.cast(e, out), c
        return nll, tf.cast(e, out), c, tf.reduce_sum(e * c[:, None], 0)

    def grad(z, bias, y, lse, g):
        """One block's ``(dz [R, C], dbias [C])`` given the rows' log-sum-exp."""
        z = tf.cast(z, tf.float32) + bias
        dz = (tf.exp(z - lse[:, None]) - tf.one_hot(y, tf.shape(z)[1])) * g[:, None]
        return tf.cast(dz, out), tf.reduce_sum(dz, 0)

    return _Kernels(when_shapes_fixed(stats), when_shapes_fixed(loss_and_grad),
                    when_shapes_fixed(grad))
