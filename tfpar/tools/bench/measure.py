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
from typing import Any, Iterator, Sequence

import numpy as np

from tfpar.tools.bench import roofline
from tfpar.tools.bench.contenders import (SPE, TWO_DEVICE, Contender, ContenderFailed, Segment,
                                          TfparContender, build_available,
                                          distribution_configs, in_memory_twin,
                                          keras_baseline, variant_configs)
from tfpar.tools.bench.remote import ContenderServer
from tfpar.tools.bench.spec import BenchSpec, target_verdicts
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


def paired_segments(a: Contender, b: Contender, rounds: int, steps: int
                    ) -> list[tuple[Segment, Segment]]:
    """``rounds`` pairs of back-to-back segments of ``steps`` steps of ``a`` and ``b``
    (the order alternates)."""
    out = []
    for r in range(rounds):
        order = (a, b) if r % 2 == 0 else (b, a)
        got = {}
        for c in order:
            with failing_as(c.name):
                got[id(c)] = c.segment(steps)
        out.append((got[id(a)], got[id(b)]))
    return out


def paired_segment_rates(a: Contender, b: Contender, spec: BenchSpec
                         ) -> tuple[list[float], list[float]]:
    """Tokens/s of ``a`` and ``b`` in ``spec.rounds`` pairs of back-to-back segments of
    ``spec.steps`` steps (the order alternates)."""
    pairs = paired_segments(a, b, spec.rounds, spec.steps)
    return ([sa.tokens / sa.seconds for sa, _ in pairs],
            [sb.tokens / sb.seconds for _, sb in pairs])


def host_overhead(t_one: float, t_many: float, n: int) -> float:
    """The host time per step that ``n`` steps per call save, from the step times with 1
    and with ``n`` per call: the call's own cost ``o`` is paid every step with 1 and every
    ``n``-th with ``n``, so ``t_one - t_many = o (1 - 1/n)``; clipped at 0."""
    return max(0.0, (t_one - t_many) / (1.0 - 1.0 / n))


def gain_at(step_seconds: float, overhead: float, n: int) -> float:
    """The speed-up of ``n`` steps per call for a step that takes ``step_seconds`` with
    one per call, ``overhead`` of it on the host between steps."""
    return step_seconds / (step_seconds - overhead * (1.0 - 1.0 / n))


def steps_per_execution(one: Contender, many: Contender, spec: BenchSpec, setup: Setup
                        ) -> dict[str, Any]:
    """``--steps-per-execution SPE`` against 1, on the default strategy: the ratio of
    tokens/s in back-to-back segments and the step times; and the host overhead per step,
    measured where compute does not hide it: the same call path on a tiny model
    (:data:`~tfpar.tools.bench.contenders.PROBE_MODEL`), whose step times with 1 and SPE
    per call differ by that overhead; from it, the gain expected at this step and at a
    5 ms one."""
    from tfpar.config import DistConfig
    from tfpar.tools.bench.contenders import build_tfpar

    steps = max(SPE, spec.steps // SPE * SPE)  # whole calls
    pairs = paired_segments(many, one, spec.rounds * 2, steps)
    ratios = [(m.tokens / m.seconds) / (o.tokens / o.seconds) for m, o in pairs]
    t_many = float(np.median([m.seconds / steps for m, _ in pairs]))
    t_one = float(np.median([o.seconds / steps for _, o in pairs]))
    with failing_as("overhead_probe"):
        probes = [build_tfpar(setup, f"probe_spe{n}", DistConfig(strategy="default"),
                              steps_per_execution=n, probe=True)[0] for n in (1, SPE)]
        for p in probes:
            p.warm_up(spec.warmup)
    probe_pairs = paired_segments(probes[1], probes[0], spec.rounds * 4, 5 * SPE)
    p_many = float(np.median([m.seconds / (5 * SPE) for m, _ in probe_pairs]))
    p_one = float(np.median([o.seconds / (5 * SPE) for _, o in probe_pairs]))
    overhead = host_overhead(p_one, p_many, SPE)
    return {f"spe{SPE}_vs_1": float(np.median(ratios)),
            f"spe{SPE}_vs_1_per_round": ratios,
            "spe_step_ms": {"1": t_one * 1e3, str(SPE): t_many * 1e3},
            "probe_step_ms": {"1": p_one * 1e3, str(SPE): p_many * 1e3},
            "host_overhead_ms_per_step": overhead * 1e3,
            f"spe{SPE}_expected_gain": gain_at(t_one, min(overhead, t_one / 2), SPE),
            f"spe{SPE}_gain_at_5ms_step": gain_at(0.005, overhead, SPE)}


def roofline_figures(spec: BenchSpec, vocab_size: int, rate: dict[str, float],
                     precision_of: dict[str, str]) -> dict[str, Any]:
    """This host's matmul limit for the step's shapes (fp32 and bf16), the step's FLOPs,
    and every contender's FLOP/s and fraction of the limit (from its side-by-side
    tokens/s); see :mod:`tfpar.tools.bench.roofline`."""
    mms = roofline.step_matmuls(layers=spec.layers, embed_dim=spec.embed_dim,
                                hidden_dim=spec.hidden_dim, vocab_size=vocab_size,
                                batch_size=spec.batch_size, bptt=spec.bptt)
    rates = roofline.measure_rates(mms, min_seconds=spec.roofline_seconds)
    tokens = spec.batch_size * spec.bptt
    flops_per_token = roofline.step_flops(mms) / tokens
    limit = {p: tokens / roofline.limit_seconds(mms, rates, p) for p in ("fp32", "bf16")}
    return {
        "flops_per_token": flops_per_token,
        "matmul_gflops": {dt: {k: v / 1e9 for k, v in table.items()} for dt, table in rates.items()},
        "matmuls": [dataclasses.asdict(m) for m in mms],
        "limit_tokens_per_sec": limit,
        "bf16_limit_vs_fp32_limit": limit["bf16"] / limit["fp32"],
        "gflops": {n: r * flops_per_token / 1e9 for n, r in rate.items()},
        "fraction_of_limit": {n: r / limit[precision_of.get(n, "fp32")]
                              for n, r in rate.items()},
    }


def padding(setup: Setup) -> dict[str, float]:
    """Pad shares of one training epoch of sentence batches: tfpar's bucketing and a plain
    ``padded_batch`` of the same shuffled sentences (long ones split the same way)."""
    import tensorflow as tf

    from tfpar.data.pipeline import count_tokens
    from tfpar.data.vocab import PAD_ID

    data, size = setup.sentence_data, setup.spec.batch_size
    real_b, slots_b = count_tokens(data.batches("train", training=True, epoch=0, batch_size=size))
    # The very same examples, unbucketed.
    examples = data._examples(data.pipeline_lines("train", shuffle=True, epoch=0))
    naive = examples.padded_batch(size, padding_values={"inputs": PAD_ID, "targets": PAD_ID})
    real_n, slots_n = count_tokens(naive.prefetch(tf.data.AUTOTUNE))
    assert real_n == real_b, (real_n, real_b)  # same tokens, only the padding differs
    return {"pad_fraction_bucketed": pad_fraction(real_b, slots_b),
            "pad_fraction_naive": pad_fraction(real_n, slots_n),
            "sentence_tokens": real_b, "bucket_count": len(data.boundaries) + 1}


# ----------------------------------------------------------------------------- the run
def step_breakdown(spec: BenchSpec, setup: Setup, results: dict[str, Any], other: str
                   ) -> dict[str, Any]:
    """The default step split into its softmax part, its RNN part and the rest, in fp32
    and bf16, each against its matmul limit (:mod:`tfpar.tools.bench.breakdown`)."""
    from tfpar.tools.bench import breakdown

    roof, rate = results["roofline"], results["side_by_side_tokens_per_sec"]
    rates = {dt: {k: v * 1e9 for k, v in table.items()}
             for dt, table in roof["matmul_gflops"].items()}
    tokens = spec.batch_size * spec.bptt
    step_ms = {spec.precision: tokens / rate["default"] * 1e3}
    if f"default_{other}" in rate:
        step_ms[other] = tokens / rate[f"default_{other}"] * 1e3
    return breakdown.measure(spec, len(setup.vocab), rates, step_ms)


def breakdown_sentence(spec: BenchSpec, setup: Setup, results: dict[str, Any]
                       ) -> dict[str, Any]:
    """The parts again as sentence mode traces them (unknown batch and time dimensions:
    TensorFlow's kernels, no XLA), without a step to split."""
    from tfpar.tools.bench import breakdown

    rates = {dt: {k: v * 1e9 for k, v in table.items()}
             for dt, table in results["roofline"]["matmul_gflops"].items()}
    return breakdown.measure(spec, len(setup.vocab), rates, {}, mode="sentence")


def output_layer_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The output layer's part of the step, fused and unfused, as a fraction of its
    matmul limit, per mode and precision; and the default step with the fused output
    layer against the same step unfused (side-by-side tokens/s)."""
    out: dict[str, Any] = {}
    for mode, key in (("stream", "breakdown"), ("sentence", "breakdown_sentence")):
        for precision, row in (results.get(key) or {}).items():
            for part in ("softmax", "softmax_unfused"):
                name = f"{part.replace('softmax', 'output_layer')}_{precision}_{mode}"
                out[f"{name}_fraction_of_limit"] = row[part]["fraction"]
    rate = results["side_by_side_tokens_per_sec"]
    if "default_unfused" in rate:
        out["fused_vs_unfused"] = rate["default"] / rate["default_unfused"]
    return out


def scaling_figures(spec: BenchSpec, results: dict[str, Any], loopback: Sequence[int] = ()
                    ) -> dict[str, Any]:
    """The scaling model's tables for 1/2/4/8 GPUs and workers, and its check against
    ``loopback`` multi_worker processes on this host (:mod:`tfpar.tools.bench.scaling`).

    The loopback job trains a global batch rounded up to a multiple of every count (so
    each worker gets a whole share)."""
    from tfpar.tools.bench import scaling

    roof = results["roofline"]
    tokens = spec.batch_size * spec.bptt
    params = roofline.parameter_count(layers=spec.layers, embed_dim=spec.embed_dim,
                                      hidden_dim=spec.hidden_dim,
                                      vocab_size=results["vocab_size"])
    work = scaling.Workload(flops=roof["flops_per_token"] * tokens, tokens=tokens,
                            gradient_bytes=4.0 * params, layers=spec.layers, bptt=spec.bptt)
    host = results.get("host_overhead_ms_per_step", 0.0) / 1e3
    counts = (1, 2, 4, 8)
    out: dict[str, Any] = {
        "gradient_bytes": work.gradient_bytes, "host_seconds": host, "tables": {
            f"{device.name}, {mode}": scaling.scaling_table(work, device, counts,
                                                            host_seconds=host,
                                                            weak=mode == "weak")
            for device in (scaling.H100_NVLINK, scaling.H200_IB, scaling.H100_ETHERNET)
            for mode in ("strong", "weak")},
    }
    if not loopback:
        return out
    from tfpar.tools.bench.workers import measure_loopback

    unit = int(np.lcm.reduce(list(loopback)))
    batch = -(-spec.batch_size // unit) * unit
    # One process with every core, at that batch: what each of N processes sharing the
    # cores computes in the same time (N shares of 1/N of the work each).
    t_one = results["step_seconds"]["default"] * batch / spec.batch_size
    checks = []
    for n in loopback:
        got = measure_loopback(dataclasses.replace(spec, batch_size=batch), n)
        bw, lat = scaling.fit_link((got["small_bytes"], got["gradient_bytes"]),
                                   (got["small"], got["allreduce"]), n)
        comm = scaling.communication_seconds(n, got["gradient_bytes"], bw, lat)
        from_phases = got["compute"] + comm
        from_model = t_one + comm
        checks.append({**got, "link_bandwidth": bw, "link_latency": lat,
                       "predicted_from_phases": from_phases,
                       "predicted_from_one_process": from_model,
                       "error_from_phases": from_phases / got["step"] - 1.0,
                       "error_from_one_process": from_model / got["step"] - 1.0})
    out["loopback"] = checks
    return out


def run(spec: BenchSpec, *, loopback: Sequence[int] = ()) -> dict[str, Any]:
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
        "vocab_size": len(setup.vocab),
        "cpu_count": os.cpu_count(),
    }
    results.update(padding(setup))

    with failing_as("keras_baseline"):
        keras_contender = keras_baseline(setup)
    local_names = [n for n in distribution_configs() if n not in TWO_DEVICE]
    local_names += list(variant_configs(spec))
    tfpar, distribution = build_available(setup, local_names, spec.warmup)
    if "default" not in tfpar:
        raise ContenderFailed("default", distribution["default"].removeprefix("failed: "))
    server = ContenderServer(spec, TWO_DEVICE)
    try:
        results = _measure(spec, setup, results, keras_contender, tfpar, distribution,
                           server, started, load_before)
    finally:
        server.close()
    results["scaling"] = scaling_figures(spec, results, loopback)
    if loopback:
        errors = [abs(c["error_from_one_process"]) for c in results["scaling"]["loopback"]]
        results["scaling_model_max_error"] = max(errors)
        results["targets"] = target_verdicts(results)
    results["seconds"] = time.time() - started
    return results


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
    # bf16 against fp32, and ten steps per call against one, each on no strategy.
    other = "bf16" if spec.precision == "fp32" else "fp32"
    precision_pairs = (paired_segment_rates(default, tfpar[f"default_{other}"], spec)
                       if f"default_{other}" in tfpar else None)
    spe = (steps_per_execution(default, tfpar[f"default_spe{SPE}"], spec, setup)
           if f"default_spe{SPE}" in tfpar else {})
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
    if precision_pairs:
        fp32, bf16 = precision_pairs if spec.precision == "fp32" else precision_pairs[::-1]
        per_round = [b / f for b, f in zip(bf16, fp32)]
        results.update({"bf16_vs_fp32": float(np.median(per_round)),
                        "bf16_vs_fp32_per_round": per_round})
    results.update(spe)
    precision_of = {n: spec.precision for n in rate}
    precision_of.update({"keras_baseline": "fp32", f"default_{other}": other})
    results["roofline"] = roofline_figures(spec, len(setup.vocab), rate, precision_of)
    results["default_fraction_of_limit"] = results["roofline"]["fraction_of_limit"]["default"]
    results["breakdown"] = step_breakdown(spec, setup, results, other)
    results["breakdown_sentence"] = breakdown_sentence(spec, setup, results)
    results.update(output_layer_figures(results))
    results["mirrored2_vs_default"] = results["distribution_vs_default"].get("mirrored2")
    results["targets"] = target_verdicts(results)
    return results
