"""Where a training step's time goes beyond its matmuls: the step split in two parts.

The roofline (:mod:`tfpar.tools.bench.roofline`) says what the step's products alone
would take; this times the step's two big parts on their own, with the model's own
layers, forward and backward, in fp32 and bf16, at the benchmark's shapes:

* ``softmax``: the output layer and its loss as the step runs them, fused
  (``tfpar.objective.fused``): from ``[B, T, H]`` hidden states the token-weighted
  cross-entropy and the gradients of the hidden states, the softmax weights and bias,
  block by block, with the logits' passes (bias, log-sum-exp, their gradient) on each
  block in cache; three products;
* ``softmax_unfused``: the same with ``--no-fused-softmax``: logits ``[B, T, V]`` from the
  model's softmax layer, the cross-entropy (``tfpar.objective.losses``) and the tape's
  gradients: the same three products plus full passes over the logits;
* ``rnn``: the LSTM stack (``tfpar.model.layers``, XLA loops as in stream mode) from the
  embeddings, gradients of the inputs and every kernel: the large products, the ``2 T L``
  dependent recurrent ones, and the gates;

and what is left of the measured step (embedding, gradient clipping, the optimizer, the
input pipeline and the host) is ``rest`` (the step minus ``softmax`` and ``rnn``). Each
part is also given at the limit (its products at this host's rate for each shape), so
``measured - limit`` is what it spends on anything but matmuls.

Two modes: ``stream`` (fixed window shapes: the parts' elementwise work runs XLA-compiled,
as stream mode's step does) and ``sentence`` (traced with unknown batch and time
dimensions, as sentence mode's buckets are: TensorFlow's kernels).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tfpar.tools.bench import roofline
from tfpar.tools.bench.spec import BenchSpec
from tfpar.tools.bench.workload import model_config


# Rounds of every part and its limit, measured in turn.
ROUNDS = 3


def _median_ms(fn, calls: int = 8, rounds: int = 3) -> float:
    fn()
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        np.asarray(out)  # the last call's result is in hand
        times.append((time.perf_counter() - start) / calls * 1e3)
    return float(np.median(times))


def part_functions(spec: BenchSpec, vocab_size: int, precision: str, *, mode: str = "stream"):
    """``{"softmax": fn, "softmax_unfused": fn, "rnn": fn}``: each runs its part forward
    and backward once and returns a scalar; ``mode`` "sentence" traces them with unknown
    batch and time dimensions."""
    import dataclasses

    import tensorflow as tf

    from tfpar.model.lm import build_model
    from tfpar.objective.output import output_loss

    config = model_config(spec, precision, fused=True)
    model = build_model(config, vocab_size, seed=spec.seed)
    unfused = build_model(dataclasses.replace(config, fused_softmax=False), vocab_size,
                          seed=spec.seed)
    b, t = spec.batch_size, spec.bptt
    gen = tf.random.Generator.from_seed(spec.seed)
    hidden = gen.normal([b, t, spec.hidden_dim])
    embedded = gen.normal([b, t, spec.embed_dim])
    targets = gen.uniform([b, t], 1, vocab_size, dtype=tf.int32)
    rnn_vars = [v for rnn in model.rnns for v in rnn.trainable_variables]
    rows = [None, None] if mode == "sentence" else [b, t]

    def softmax_of(m):
        variables = m.softmax.trainable_variables

        @tf.function(autograph=False, input_signature=[tf.TensorSpec(rows + [spec.hidden_dim]),
                                                       tf.TensorSpec(rows, tf.int32)])
        def softmax(h, y):
            with tf.GradientTape() as tape:
                tape.watch(h)
                nll, count = output_loss(m.config).nll(m, h, y, for_gradient=True)
                loss = nll / count
            grads = tape.gradient(loss, [h] + variables)
            return tf.add_n([tf.reduce_sum(g[:1]) for g in grads])

        return lambda: softmax(hidden, targets)

    @tf.function(autograph=False, input_signature=[tf.TensorSpec(rows + [spec.embed_dim])])
    def rnn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = x
            for layer in model.rnns:
                out = layer(out)[0]
            loss = tf.reduce_mean(out * out)
        grads = tape.gradient(loss, [x] + rnn_vars)
        return tf.add_n([tf.reduce_sum(g[:1]) for g in grads])

    return {"softmax": softmax_of(model), "softmax_unfused": softmax_of(unfused),
            "rnn": lambda: rnn(embedded)}


def measure(spec: BenchSpec, vocab_size: int, rates: dict[str, dict[str, float]],
            step_ms: dict[str, float], *, mode: str = "stream") -> dict[str, Any]:
    """``{precision: {part: {"ms", "limit_ms", "fraction"}}}`` for fp32 and bf16 in
    ``mode``; ``step_ms``: the measured default step per precision (its ``rest`` is what
    the step leaves beyond the parts it runs: ``softmax``, fused, and ``rnn``), its limit
    from ``rates`` (the roofline's).

    A part's limit is measured again in every round, next to the part (its products'
    rates, :func:`roofline.measure_rates`), and its ``fraction`` of the limit is the
    median of the rounds' ratios: on a host whose load drifts, a limit measured minutes
    apart from the part would move the fraction by more than what is compared."""
    mms = roofline.step_matmuls(layers=spec.layers, embed_dim=spec.embed_dim,
                                hidden_dim=spec.hidden_dim, vocab_size=vocab_size,
                                batch_size=spec.batch_size, bptt=spec.bptt)
    softmax = [m for m in mms if m.name.startswith("softmax")]
    parts = {"softmax": softmax, "softmax_unfused": softmax,
             "rnn": [m for m in mms if m.name.startswith("lstm")]}
    fns = {p: part_functions(spec, vocab_size, p, mode=mode) for p in ("fp32", "bf16")}
    timed = {(p, part): [] for p in fns for part in parts}
    limits = {(p, part): [] for p in fns for part in parts}
    for _ in range(ROUNDS):  # parts, precisions and limits alternate, against drift
        round_rates = roofline.measure_rates(mms, min_seconds=spec.roofline_seconds)
        for precision, table in fns.items():
            for part, fn in table.items():
                timed[(precision, part)].append(_median_ms(fn))
                limits[(precision, part)].append(
                    roofline.limit_seconds(parts[part], round_rates, precision) * 1e3)
    out: dict[str, Any] = {}
    for precision in fns:
        row = {}
        for part in parts:
            ms, limit = (np.array(x[(precision, part)]) for x in (timed, limits))
            row[part] = {"ms": float(np.median(ms)), "limit_ms": float(np.median(limit)),
                         "fraction": float(np.median(limit / ms))}
        if precision in step_ms:
            row["rest"] = {"ms": step_ms[precision] - row["softmax"]["ms"] - row["rnn"]["ms"],
                           "limit_ms": 0.0}
            row["step"] = {"ms": step_ms[precision],
                           "limit_ms": roofline.limit_seconds(mms, rates, precision) * 1e3}
        out[precision] = row
    return out
