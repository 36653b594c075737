"""Measuring: interleaved rounds, back-to-back pairs, padding, and the whole run.

Any exception a contender raises while it is timed becomes :class:`ContenderFailed`
(one line naming it) and ends the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Iterator

import numpy as np

from tfpar.tools.bench.contenders import (TWO_DEVICE, Contender, ContenderFailed, Segment,
                                          TfparContender, build_available,
                                          distribution_configs, in_memory_twin,
                                          keras_baseline)
from tfpar.tools.bench.remote import ContenderServer
from tfpar.tools.bench.spec import BenchSpec, check_targets
from tfpar.tools.bench.workload import Setup, load_setup

log = logging.getLogger("tfpar.tools.bench")


# ----------------------------------------------------------------------------- arithmetic
def pad_fraction(real: int, slots: int) -> float:
    """Share of padded slots: ``1 - real / slots`` (0 for no slots)."""
    return 1.0 - real / slots if slots else 0.0


def stall_fraction(t_memory: float, t_tfdata: float) -> float:
    """Share of a tf.data-fed step spent waiting for input: ``1 - t_memory / t_tfdata``,
    clipped at 0 (noise can make the tf.data-fed step the faster one)."""
    if not t_tfdata > 0:
        return 0.0
    return max(0.0, 1.0 - t_memory / t_tfdata)


def ratio(a: Any, b: Any) -> float | None:
    """``a / b`` for two measured rates; None when either is missing."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return a / b


def input_wait_fraction(pairs: list[tuple[Segment, Segment]]) -> float:
    """Share of the tf.data-fed steps (second of each pair) spent getting their batch,
    beyond what the in-memory steps (first) spend: what the input pipeline adds to a
    step, timed directly rather than as the difference of two noisy step times."""
    extra = sum(tf_step.wait_seconds - mem.wait_seconds for mem, tf_step in pairs)
    return max(0.0, extra / sum(tf_step.seconds for _, tf_step in pairs))


# ----------------------------------------------------------------------------- timing
@contextlib.contextmanager
def failing_as(name: str) -> Iterator[None]:
    """Turns an exception raised inside into :class:`ContenderFailed` naming ``name``."""
    try:
        yield
    except ContenderFailed:
        raise
    except Exception as e:
        log.warning("%s failed: %s", name, e)
        raise ContenderFailed(name, e) from e


def interleave(contenders: list[Contender], spec: BenchSpec) -> dict[str, dict[str, float]]:
    """Runs every contender ``spec.rounds`` times for ``spec.steps`` steps, round-robin
    with the order rotated each round.

    Returns:
      name -> medians over rounds of ``tokens_per_sec`` (wall), ``step_seconds`` and
      ``tokens_per_cpu_sec`` (tokens per second of process CPU time: less sensitive to
      other processes on a busy host, though it counts spinning worker threads too).

    Raises:
      ContenderFailed: a contender's segment raised.
    """
    segments: dict[str, list[Segment]] = {c.name: [] for c in contenders}
    for r in range(spec.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            with failing_as(c.name):
                segments[c.name].append(c.segment(spec.steps))
        log.info("round %d/%d: %s", r + 1, spec.rounds, ", ".join(
            f"{n} {s[-1].tokens / s[-1].seconds:.0f}" for n, s in segments.items()))
    return {n: {
        "tokens_per_sec": float(np.median([s.tokens / s.seconds for s in segs])),
        "step_seconds": float(np.median([s.seconds / spec.steps for s in segs])),
        "tokens_per_cpu_sec": float(np.median([s.tokens / s.cpu_seconds for s in segs])),
    } for n, segs in segments.items()}


def _step(c: TfparContender) -> Segment:
    with failing_as(c.name):
        return c.step()


def paired_steps(a: TfparContender, b: TfparContender, pairs: int
                 ) -> list[tuple[Segment, Segment]]:
    """``pairs`` pairs of back-to-back steps of ``a`` and ``b`` (the order alternates): the
    finest A/B pairing, so a change of load hits both sides."""
    out = []
    for i in range(pairs):
        if i % 2:
            tb, ta = _step(b), _step(a)
        else:
            ta, tb = _step(a), _step(b)
        out.append((ta, tb))
    return out


def paired_step_ratios(a: TfparContender, b: TfparContender, pairs: int) -> list[float]:
    """``a``'s step time over ``b``'s, for each of :func:`paired_steps`."""
    return [ta.seconds / tb.seconds for ta, tb in paired_steps(a, b, pairs)]


def paired_segment_rates(a: Contender, b: Contender, spec: BenchSpec
                         ) -> tuple[list[float], list[float]]:
    """Tokens/s of ``a`` and ``b`` in ``spec.rounds`` pairs of back-to-back segments of
    ``spec.steps`` steps (the order alternates)."""
    rates_a, rates_b = [], []
    for r in range(spec.rounds):
        order = (a, b) if r % 2 == 0 else (b, a)
        got = {}
        for c in order:
            with failing_as(c.name):
                got[id(c)] = c.segment(spec.steps)
        rates_a.append(got[id(a)].tokens / got[id(a)].seconds)
        rates_b.append(got[id(b)].tokens / got[id(b)].seconds)
    return rates_a, rates_b


def padding(setup: Setup) -> dict[str, float]:
    """Pad shares of one training epoch of sentence batches: tfpar's bucketing and a plain
    ``padded_batch`` of the same shuffled sentences (long ones split the same way)."""
    import tensorflow as tf

    from tfpar.data.pipeline import count_tokens
    from tfpar.data.vocab import PAD_ID

    data, size = setup.sentence_data, setup.spec.batch_size
    real_b, slots_b = count_tokens(data.batches("train", training=True, epoch=0, batch_size=size))
    lines = data.splits["train"]
    order = np.random.default_rng([data.seed, 0]).permutation(len(lines))
    examples = data._examples([lines[i] for i in order])  # the very same examples, unbucketed
    naive = examples.padded_batch(size, padding_values={"inputs": PAD_ID, "targets": PAD_ID})
    real_n, slots_n = count_tokens(naive.prefetch(tf.data.AUTOTUNE))
    assert real_n == real_b, (real_n, real_b)  # same tokens, only the padding differs
    return {"pad_fraction_bucketed": pad_fraction(real_b, slots_b),
            "pad_fraction_naive": pad_fraction(real_n, slots_n),
            "sentence_tokens": real_b, "bucket_count": len(data.boundaries) + 1}


# ----------------------------------------------------------------------------- the run
def run(spec: BenchSpec) -> dict[str, Any]:
    """Every measurement; returns the results dict that goes to ``--json``.

    A tfpar contender that fails to build or warm up is recorded in
    ``distribution_tokens_per_sec`` as ``"failed: ..."`` and the others are measured
    (:func:`tfpar.tools.bench.report.failed_contenders` lists them).

    Raises:
      ContenderFailed: tfpar's default strategy or the Keras baseline could not be built,
        the child process died, or a contender raised while it was timed.
    """
    started = time.time()
    load_before = os.getloadavg()
    setup = load_setup(spec)
    results: dict[str, Any] = {
        "spec": dataclasses.asdict(spec), "corpus": setup.corpus_name,
        "corpus_note": setup.corpus_note, "vocab_size": len(setup.vocab),
        "cpu_count": os.cpu_count(),
    }
    results.update(padding(setup))

    with failing_as("keras_baseline"):
        keras_contender = keras_baseline(setup)
    local_names = [n for n in distribution_configs() if n not in TWO_DEVICE]
    tfpar, distribution = build_available(setup, local_names, spec.warmup)
    if "default" not in tfpar:
        raise ContenderFailed("default", distribution["default"].removeprefix("failed: "))
    server = ContenderServer(spec, TWO_DEVICE)
    try:
        return _measure(spec, setup, results, keras_contender, tfpar, distribution, server,
                        started, load_before)
    finally:
        server.close()


def _measure(spec, setup, results, keras_contender, tfpar, distribution, server, started,
             load_before) -> dict[str, Any]:
    distribution.update({n: s for n, s in server.status.items() if s != "ok"})
    remote = server.contenders()
    contenders: list[Contender] = [keras_contender, *tfpar.values(), *remote.values()]
    default = tfpar["default"]
    with failing_as(default.name):
        memory = in_memory_twin(default, spec.steps)
    # Warm every local contender again once all exist: building a strategy drops compiled
    # (XLA) kernels of the ones built before it.
    for contender in contenders:
        with failing_as(contender.name):
            contender.warm_up(spec.warmup)

    # The headline figures, each from back-to-back pairs (a busy host's load drifts):
    # Keras against tfpar in whole segments (fit runs a segment at a time), tfpar as
    # `scripts/train.py --strategy mirrored` runs on this host and with no strategy ...
    pairs_by = {"default": paired_segment_rates(keras_contender, default, spec)}
    if "mirrored2" in remote:
        pairs_by["mirrored"] = paired_segment_rates(keras_contender, remote["mirrored2"], spec)
    headline = "mirrored" if "mirrored" in pairs_by else "default"
    # ... and the input stall and the one-replica mirrored cost step by step.
    pairs = spec.rounds * spec.steps
    input_pairs = paired_steps(memory, default, pairs)
    memory_over_tfdata = [m.seconds / t.seconds for m, t in input_pairs]
    default_over_mirrored1 = (paired_step_ratios(default, tfpar["mirrored1"], pairs)
                              if "mirrored1" in tfpar else None)
    # Every contender side by side, for the distribution table.
    measured = interleave(contenders, spec)

    rate = {n: m["tokens_per_sec"] for n, m in measured.items()}
    for name in distribution_configs():
        distribution.setdefault(name, rate.get(name))
    for name, (keras_rates, tfpar_rates) in pairs_by.items():
        per_round = [t / k for t, k in zip(tfpar_rates, keras_rates)]
        results.update({
            f"tfpar_{name}_tokens_per_sec": float(np.median(tfpar_rates)),
            f"tfpar_{name}_vs_keras_baseline": float(np.median(per_round)),
            f"tfpar_{name}_vs_keras_baseline_per_round": per_round,
        })
    default_rate = results["tfpar_default_tokens_per_sec"]
    results.update({
        "keras_baseline_tokens_per_sec": float(np.median(pairs_by[headline][0])),
        # The headline: tfpar as its quick start runs it (mirrored over the host's logical
        # CPU devices), or with no strategy when mirrored is not available.
        "tfpar_strategy": headline,
        "tfpar_tokens_per_sec": results[f"tfpar_{headline}_tokens_per_sec"],
        "tfpar_vs_keras_baseline": results[f"tfpar_{headline}_vs_keras_baseline"],
        "tfpar_vs_keras_baseline_per_round":
            results[f"tfpar_{headline}_vs_keras_baseline_per_round"],
        # What getting the batch from tf.data adds to a step, timed directly (the step
        # waits in next(iterator) while the pipeline produces it) ...
        "input_stall_fraction": input_wait_fraction(input_pairs),
        # ... and as 1 - t_memory / t_tfdata of whole steps, the median of step-by-step
        # pairs: the same share plus any slowdown from the pipeline's background threads,
        # but with the host's step-time noise (a few % here) on top.
        "input_stall_fraction_ab": stall_fraction(float(np.median(memory_over_tfdata)), 1.0),
        "tfpar_in_memory_tokens_per_sec": default_rate * float(np.median(
            [1.0 / x for x in memory_over_tfdata])),
        "mirrored1_vs_default": (float(np.median(default_over_mirrored1))
                                 if default_over_mirrored1 else None),
        "distribution_tokens_per_sec": distribution,
        # Every contender's median in the side-by-side rounds, Keras included (the table
        # and the chart compare these with each other).
        "side_by_side_tokens_per_sec": rate,
        "distribution_vs_default": {  # within the side-by-side table
            n: ratio(v, rate["default"]) if isinstance(v, float) else v
            for n, v in distribution.items()},
        "step_seconds": {n: m["step_seconds"] for n, m in measured.items()},
        # The same comparison in tokens per CPU-second: on a busy host, where wall time
        # depends on what else runs, this ratio is the steadier one.
        "tokens_per_cpu_sec": {n: m["tokens_per_cpu_sec"] for n, m in measured.items()},
        "tfpar_vs_keras_baseline_cpu": ratio(
            measured["mirrored2" if headline == "mirrored" else "default"]["tokens_per_cpu_sec"],
            measured["keras_baseline"]["tokens_per_cpu_sec"]),
        "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0],
        "seconds": time.time() - started,
    })
    results["targets"] = {name: {"value": value, "target": f"{op} {threshold}", "pass": ok}
                          for name, value, op, threshold, ok in check_targets(results)}
    return results
