"""How much the pipeline's micro-batches overlap: step time for M = 1, 2, 4, 8.

    python tests/bench_pipeline.py                          # 2 logical CPUs, prints a table
    python tests/bench_pipeline.py --micro-batches 1,2,4,8,16 --hidden-dim 512

For each M, :func:`pipeline_sweep` trains the same model on the same fixed batch with the
pipeline plug-in (stages on two devices) and reports the median step time next to the
bubble fraction (S-1)/(M+S-1) GPipe's schedule predicts. With ``one_device=True`` it
also times the same M with every stage on the first device: that run cuts the batch the
same way but cannot overlap anything, so ``one_device_step_seconds / step_seconds`` is
what the overlap itself buys, apart from what smaller micro-batches cost or save.

What a CPU-only host can show: logical CPU devices are one CPU split in name only. They
share the process's inter-op thread pool (which runs independent ops concurrently: this
is what lets stage 1 work on micro-batch j while stage 0 works on j+1) and its intra-op
pool (which splits one large op over cores). So two stages can at best keep the physical
cores busy with two independent ops at once; what the overlap gains over M = 1 is the
share of the step that one op at a time leaves idle - large for an LSTM's many small
per-time-step ops, small when big matrix products already fill every core.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from typing import Sequence

from tfpar.tools.parsing import Parser

DEFAULT_STAGES = "embedding=/cpu:0,rnn_0=/cpu:0,rnn_1=/cpu:1,softmax=/cpu:1"


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle share of a step: (S-1)/(M+S-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def _batch(batch_size: int, seq_len: int, vocab_size: int, seed: int) -> dict:
    import tensorflow as tf

    ids = tf.random.stateless_uniform([batch_size, seq_len + 1], seed=[seed, 1], minval=1,
                                      maxval=vocab_size, dtype=tf.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def _train_step(stages: str, micro_batches: int, model_config, vocab_size: int, seed: int):
    """A pipeline train step on fresh weights; returns (step, number of stages)."""
    import keras

    from tfpar.config import DistConfig
    from tfpar.objective.step import make_train_step
    from tfpar.parallel.registry import build_strategy
    from tfpar.training.state import build_train_state

    plugin = build_strategy(DistConfig(strategy="pipeline", stages=stages,
                                       micro_batches=micro_batches))
    state = build_train_state(plugin.scope(), model_config, vocab_size, seed=seed,
                              make_optimizer=lambda epoch, lr_scale: keras.optimizers.SGD(0.01))
    step = make_train_step(plugin, state.model, state.optimizer, clip_norm=5.0)
    return step, len(plugin.stages)


def _one_device(stages: str) -> str:
    """The same parts, every one on the first device named in ``stages``."""
    from tfpar.parallel.pipeline.stages import parse_stages

    spec = parse_stages(stages)
    first = next(iter(spec.values()))
    return ",".join(f"{part}={first}" for part in spec)


# A pipeline op's name: its stage, direction and micro-batch (see tfpar.parallel.pipeline).
_PIECE = re.compile(r"^(?:gradient_tape/)?stage_(\d+)/(?:forward|backward)_mb_(\d+)/")


def measure_overlap(step, batch: dict, *, steps: int = 2) -> float:
    """Share of the step's wall time in which two stages run ops of two different
    micro-batches at the same moment: the pipelining itself, seen in a profile.

    Profiles ``steps`` steps with ``tf.profiler`` and reads every TensorFlow op event of
    the host plane (one line per inter-op thread); an op belongs to the (stage,
    micro-batch) its name scope says. Profiling slows the ops down, so this is a
    fraction, not a time. 0 at M = 1 by construction; NaN when the profile cannot be read.
    """
    import glob
    import tempfile

    import tensorflow as tf

    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # The profiler's proto moved: report nothing rather than guess.
        return float("nan")
    with tempfile.TemporaryDirectory(prefix="tfpar-bench-") as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(steps):
                float(step(batch).nll_sum)
        finally:
            tf.profiler.experimental.stop()
        files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return float("nan")
        space = xplane_pb2.XSpace()
        with open(files[0], "rb") as f:
            space.ParseFromString(f.read())
    plane = next((p for p in space.planes if p.name == "/host:CPU"), None)
    if plane is None:
        return float("nan")
    edges, wall = [], 0
    for line in plane.lines:
        base = line.timestamp_ns * 1000
        for e in line.events:
            name = plane.event_metadata[e.metadata_id].name
            start, end = base + e.offset_ps, base + e.offset_ps + e.duration_ps
            if name == "train_step":
                wall += end - start
            m = _PIECE.match(name)
            if m:
                piece = (int(m.group(1)), int(m.group(2)))
                edges += [(start, 1, piece), (end, -1, piece)]
    # Sweep over op starts and ends, counting the running ops of each (stage, mb).
    edges.sort(key=lambda e: (e[0], e[1]))
    running: dict[tuple[int, int], int] = {}
    overlap, last = 0, None
    for t, delta, piece in edges:
        if last is not None and len({k for k, _ in running}) > 1 \
                and len({j for _, j in running}) > 1:
            overlap += t - last
        running[piece] = running.get(piece, 0) + delta
        if not running[piece]:
            del running[piece]
        last = t
    return overlap / wall if wall else float("nan")


def pipeline_sweep(micro_batches: Sequence[int] = (1, 2, 4, 8), *,
                   stages: str = DEFAULT_STAGES, batch_size: int = 64, seq_len: int = 35,
                   vocab_size: int = 2000, embed_dim: int = 128, hidden_dim: int = 256,
                   layers: int = 2, steps: int = 5, rounds: int = 3, one_device: bool = True,
                   overlap: bool = True, seed: int = 0) -> list[dict]:
    """Median train-step time of the pipeline for each number of micro-batches.

    Every configuration is built and traced first; then ``rounds`` rounds each time
    ``steps`` steps of every configuration in turn, so a load change on a shared host
    hits all of them alike. TensorFlow's logical CPU devices must exist already
    (``tfpar.parallel.devices.configure_cpu_devices``).

    Args:
      micro_batches: the values of M to time (1 should be among them).
      stages: the ``--stages`` placement (default: 2 layers over /cpu:0 and /cpu:1).
      batch_size, seq_len, vocab_size, embed_dim, hidden_dim, layers: the model and
        its fixed random batch [batch_size, seq_len].
      steps: timed steps per configuration and round.
      rounds: interleaved rounds; the median over every timed step is reported.
      one_device: also time each M with every stage on the first device.
      overlap: also profile each M (:func:`measure_overlap`), after the timing.

    Returns:
      One dict per M: ``micro_batches``, ``step_seconds`` (median), ``stages``,
      ``bubble_fraction_theory`` = (S-1)/(M+S-1), ``speedup_vs_M1`` (step time at M=1 /
      at M, NaN without M=1) and, with ``one_device``, ``one_device_step_seconds`` and
      ``overlap_speedup`` (one device / pipelined, same M); with ``overlap``,
      ``overlap_measured`` (:func:`measure_overlap`).
    """
    from tfpar.config import ModelConfig

    model_config = ModelConfig(layers=layers, embed_dim=embed_dim, hidden_dim=hidden_dim,
                               dropout=0.0, tie_embeddings=False, init_scale=0.0)
    batch = _batch(batch_size, seq_len, vocab_size, seed)
    placements = {"pipeline": stages}
    if one_device:
        placements["one_device"] = _one_device(stages)
    runs, num_stages = {}, {}
    for m in micro_batches:
        for name, spec in placements.items():
            step, count = _train_step(spec, m, model_config, vocab_size, seed)
            for _ in range(2):  # Trace, then one more step to warm the caches.
                float(step(batch).nll_sum)
            runs[name, m] = step
            if name == "pipeline":
                num_stages[m] = count
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, step in runs.items():
            for _ in range(steps):
                start = time.perf_counter()
                float(step(batch).nll_sum)  # Waits for the step to finish.
                times[key].append(time.perf_counter() - start)
    median = {key: statistics.median(t) for key, t in times.items()}
    measured = {m: measure_overlap(runs["pipeline", m], batch) for m in micro_batches} \
        if overlap else {}
    base = median.get(("pipeline", 1))
    rows = []
    for m in micro_batches:
        row = {
            "micro_batches": m,
            "step_seconds": median["pipeline", m],
            "stages": num_stages[m],
            "bubble_fraction_theory": bubble_fraction(num_stages[m], m),
            "speedup_vs_M1": base / median["pipeline", m] if base else float("nan"),
        }
        if overlap:
            row["overlap_measured"] = measured[m]
        if one_device:
            row["one_device_step_seconds"] = median["one_device", m]
            row["overlap_speedup"] = median["one_device", m] / median["pipeline", m]
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows of :func:`pipeline_sweep` as a text table."""
    extra = "one_device_step_seconds" in rows[0]
    measured = "overlap_measured" in rows[0]
    header = f"{'M':>3} {'step s':>9} {'bubble (theory)':>16} {'speedup vs M=1':>15}"
    if measured:
        header += f" {'2 stages busy':>14}"
    if extra:
        header += f" {'1-device step s':>16} {'overlap speedup':>16}"
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (f"{r['micro_batches']:>3d} {r['step_seconds']:>9.4f} "
                f"{r['bubble_fraction_theory']:>16.3f} {r['speedup_vs_M1']:>15.2f}")
        if measured:
            line += f" {r['overlap_measured']:>14.3f}"
        if extra:
            line += f" {r['one_device_step_seconds']:>16.4f} {r['overlap_speedup']:>16.2f}"
        lines.append(line)
    return "\n".join(lines)


def _int_list(text: str) -> tuple[int, ...]:
    from tfpar.errors import ConfigError

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--micro-batches {text!r} must be comma-separated integers, "
                          f"e.g. 1,2,4,8") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--micro-batches {text!r} must list integers >= 1, e.g. 1,2,4,8")
    return values


def parser() -> argparse.ArgumentParser:
    p = Parser(
        allow_abbrev=False, prog="tests/bench_pipeline.py",
        description="Time the pipeline strategy's train step for several numbers of "
                    "micro-batches, next to GPipe's bubble fraction (S-1)/(M+S-1), and "
                    "against the same micro-batches with every stage on one device.")
    p.add_argument("--micro-batches", default="1,2,4,8", help="values of M (default: %(default)s)")
    p.add_argument("--stages", default=DEFAULT_STAGES, help="placement (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch (default: %(default)s)")
    p.add_argument("--bptt", type=int, default=35, help="sequence length (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=2000, help="(default: %(default)s)")
    p.add_argument("--embed-dim", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--hidden-dim", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps per round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds (default: %(default)s)")
    p.add_argument("--cpu-devices", type=int, default=2,
                   help="logical CPU devices (default: %(default)s)")
    p.add_argument("--inter-op-threads", type=int, default=0,
                   help="TensorFlow inter-op threads (0: TF's default, the core count)")
    p.add_argument("--intra-op-threads", type=int, default=0,
                   help="TensorFlow intra-op threads (0: TF's default, the core count)")
    p.add_argument("--no-one-device", action="store_true",
                   help="skip the one-device comparison runs")
    p.add_argument("--no-overlap", action="store_true",
                   help="skip the profiled runs that measure how often two stages run at once")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from tfpar.tools.cli import run_main, setup_logging

    args = parser().parse_args(argv)
    setup_logging(False)

    def body():
        ms = _int_list(args.micro_batches)
        import tensorflow as tf

        from tfpar.parallel import devices

        # Before anything runs on TensorFlow: threads and the logical device split.
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
        tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
        devices.configure_cpu_devices(args.cpu_devices)
        rows = pipeline_sweep(
            ms, stages=args.stages, batch_size=args.batch_size, seq_len=args.bptt,
            vocab_size=args.vocab_size, embed_dim=args.embed_dim, hidden_dim=args.hidden_dim,
            layers=args.layers, steps=args.steps, rounds=args.rounds,
            one_device=not args.no_one_device, overlap=not args.no_overlap)
        print(f"pipeline sweep: --stages {args.stages}; batch {args.batch_size}x{args.bptt}, "
              f"{args.layers}x LSTM {args.hidden_dim}, vocab {args.vocab_size}; "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; "
              f"inter-op threads {args.inter_op_threads or 'default'}, "
              f"intra-op threads {args.intra_op_threads or 'default'}")
        print(format_table(rows))

    return run_main(body)


if __name__ == "__main__":
    raise SystemExit(main())
