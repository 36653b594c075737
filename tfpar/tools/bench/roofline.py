"""The step's matmuls, their FLOPs, and this host's limit for them (the roofline).

A training step of the LSTM LM is almost all matrix products. For a global batch of
``B`` columns and ``T`` steps (``N = B * T`` tokens), an ``L``-layer LSTM of width ``H``
on embeddings of width ``E`` and a ``V``-word softmax, the step multiplies (``D`` is a
layer's input width, ``E`` for the first layer, ``H`` after it)::

    softmax   forward   [N, H] x [H, V]        backward  [N, V] x [V, H],  [H, N] x [N, V]
    per layer input     [N, D] x [D, 4H]       backward  [N, 4H] x [4H, D], [D, N] x [N, 4H]
              recurrent T x [B, H] x [H, 4H]    backward  T x [B, 4H] x [4H, H], [H, N] x [N, 4H]

``2 m k n`` FLOPs each: about ``6 H V + 24 L H (D + H)`` per token (15.8 MFLOP for the
2x200 LSTM on a 10k vocabulary, three quarters of it in the softmax). Elementwise work
(gates, log-softmax, the optimizer) is not counted.

**The limit** is the time the step would take if it did nothing but these products, each
at the rate this host's TensorFlow reaches for that very shape, measured here in the same
run (all cores; the recurrent ``T`` products in an XLA-compiled loop, the way the step runs
them in stream mode). A contender's *fraction of the limit* is that time over its
measured step time, i.e. its tokens/s over the limit's tokens/s. It can pass 1 only when
something beats TF's own kernels for a shape (the per-shape rates are measured with
every core, so two replicas on one core each may overlap what one step serialises).

With ``--precision bf16`` the large products run in bfloat16 (the recurrent ones stay
float32, as in ``tfpar.model.layers``), so the bf16 limit takes the bf16 rate for those.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Matmul:
    """``count`` products ``[m, k] x [k, n]`` per training step; ``loop``: ``count``
    sequential products inside the recurrence (timed as an XLA loop), else separate ones;
    ``large``: computed in bfloat16 under ``--precision bf16``."""

    name: str
    m: int
    k: int
    n: int
    count: int = 1
    loop: bool = False
    large: bool = True

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.k}x{self.n}"


def step_matmuls(*, layers: int, embed_dim: int, hidden_dim: int, vocab_size: int,
                 batch_size: int, bptt: int) -> list[Matmul]:
    """Every matrix product of one training step (forward and backward), global batch."""
    n_tok, h, g = batch_size * bptt, hidden_dim, 4 * hidden_dim
    out = [Matmul("softmax forward", n_tok, h, vocab_size),
           Matmul("softmax input gradient", n_tok, vocab_size, h),
           Matmul("softmax weight gradient", h, n_tok, vocab_size)]
    for layer in range(layers):
        d = embed_dim if layer == 0 else hidden_dim
        out += [Matmul(f"lstm{layer} input projection", n_tok, d, g),
                Matmul(f"lstm{layer} input gradient", n_tok, g, d),
                Matmul(f"lstm{layer} input weight gradient", d, n_tok, g),
                Matmul(f"lstm{layer} recurrent weight gradient", h, n_tok, g),
                Matmul(f"lstm{layer} recurrent step", batch_size, h, g, bptt, loop=True,
                       large=False),
                Matmul(f"lstm{layer} recurrent step gradient", batch_size, g, h, bptt,
                       loop=True, large=False)]
    return out


def parameter_count(*, layers: int, embed_dim: int, hidden_dim: int, vocab_size: int) -> int:
    """Trainable parameters of the (untied) LSTM LM: embedding, LSTM kernels and biases,
    softmax kernel and bias: each is one float32 gradient the step all-reduces."""
    lstm = sum(4 * hidden_dim * ((embed_dim if i == 0 else hidden_dim) + hidden_dim + 1)
               for i in range(layers))
    return vocab_size * embed_dim + lstm + hidden_dim * vocab_size + vocab_size


def step_flops(matmuls: Sequence[Matmul]) -> float:
    return sum(m.flops for m in matmuls)


def _timed(fn, min_seconds: float) -> float:
    """Seconds per call of ``fn`` (a ``tf.function``; on a CPU a call returns when its
    work is done): the best of three batches of calls, each at least ``min_seconds``."""
    fn()  # trace / compile
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / calls)
    return best


def measure_rate(mm: Matmul, dtype: str = "float32", *, min_seconds: float = 0.2) -> float:
    """FLOP/s this host's TensorFlow reaches for ``mm``'s shape in ``dtype``.

    A separate product is timed one per call, its operands passed as arguments (so
    nothing is constant-folded and no two products share a call); a ``loop`` product
    as ``count`` products in an XLA-compiled ``tf.while_loop``, each on the previous one's
    result (``tanh``, sliced or tiled back to ``[m, k]``), so none can be hoisted or
    merged, as in the recurrence itself."""
    import tensorflow as tf

    gen = tf.random.Generator.from_seed(0)
    dt = tf.dtypes.as_dtype(dtype)
    w = tf.cast(gen.normal([mm.k, mm.n]) * 0.05, dt)
    if mm.loop:
        x0 = tf.cast(gen.normal([mm.m, mm.k]), dt)

        def back_to_input(y):  # [m, n] -> [m, k]
            if mm.n >= mm.k:
                return y[:, :mm.k]
            return tf.tile(y, [1, -(-mm.k // mm.n)])[:, :mm.k]

        @tf.function(autograph=False, jit_compile=True)
        def run():
            def body(t, x):
                return t + 1, tf.tanh(back_to_input(tf.matmul(x, w)))

            return tf.while_loop(lambda t, x: t < mm.count, body, (tf.constant(0), x0))[1]

        return mm.count * 2.0 * mm.m * mm.k * mm.n / _timed(run, min_seconds)
    x = tf.cast(gen.normal([mm.m, mm.k]), dt)

    @tf.function(autograph=False)
    def product(x, w):
        return tf.matmul(x, w)

    return 2.0 * mm.m * mm.k * mm.n / _timed(lambda: product(x, w), min_seconds)


def measure_rates(matmuls: Sequence[Matmul], *, bf16: bool = True, min_seconds: float = 0.2
                  ) -> dict[str, dict[str, float]]:
    """``{"float32": {shape: FLOP/s}, "bfloat16": {...}}`` for every distinct shape (the
    loop products in float32 only: tfpar keeps the recurrence in float32)."""
    rates: dict[str, dict[str, float]] = {"float32": {}, "bfloat16": {}}
    for mm in matmuls:
        key = shape_key(mm)
        if key not in rates["float32"]:
            rates["float32"][key] = measure_rate(mm, "float32", min_seconds=min_seconds)
        if bf16 and mm.large and key not in rates["bfloat16"]:
            rates["bfloat16"][key] = measure_rate(mm, "bfloat16", min_seconds=min_seconds)
    if not bf16:
        del rates["bfloat16"]
    return rates


def shape_key(mm: Matmul) -> str:
    return mm.shape + (f" x{mm.count} loop" if mm.loop else "")


def limit_seconds(matmuls: Sequence[Matmul], rates: dict[str, dict[str, float]],
                  precision: str = "fp32") -> float:
    """The step's time at the limit: every product at this host's rate for its shape (in
    bfloat16 for the large ones under ``precision == "bf16"``)."""
    total = 0.0
    for mm in matmuls:
        table = "bfloat16" if precision == "bf16" and mm.large else "float32"
        total += mm.flops / rates[table][shape_key(mm)]
    return total
