"""Throughput benchmark: tfpar against plain Keras, input stalls, padding, distribution cost.

``scripts/benchmark.py`` measures, in one process and on one corpus (PTB when it is
there, else the generated corpus):

* training tokens/s of tfpar's real training step (plug-in, model, optimizer,
  ``plugin.make_train_step`` on ``InputData.batches``) against a plain-Keras baseline: the
  same architecture as a ``keras.Sequential`` trained with ``model.fit`` on fixed windows;
* the input pipeline's share of the step time: the same step fed from tf.data and from
  batches already in memory;
* the share of pad tokens in sentence mode: tfpar's bucketing against a plain
  ``padded_batch`` of the same shuffled sentences;
* the cost of distribution: mirrored with one replica against no strategy, and mirrored,
  tower and pipeline on two logical devices.

The host is shared and its load varies, so every contender is timed in short segments
and the segments are interleaved round-robin (the order rotates every round); each
figure is the median over rounds, and ratios compare segments that ran side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from tfpar.errors import ConfigError

log = logging.getLogger(__name__)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PTB = os.path.join(os.path.dirname(REPO), "shared", "data", "ptb")

# name -> (comparison, threshold); checked by check_targets.
TARGETS: dict[str, tuple[str, float]] = {
    "tfpar_vs_keras_baseline": (">=", 1.4),
    "input_stall_fraction": ("<=", 0.02),
    "pad_fraction_bucketed": ("<=", 0.03),
    "mirrored1_vs_default": (">=", 0.95),
}
NOT_AVAILABLE = "not available"


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """What to measure and for how long."""

    # Corpus folder (PTB's ptb.{train,valid,test}.txt) or "synthetic".
    data: str = DEFAULT_PTB
    # The small configuration of TensorFlow's ptb_word_lm.py.
    layers: int = 2
    embed_dim: int = 200
    hidden_dim: int = 200
    vocab_size: int = 10000
    batch_size: int = 20  # global: stream columns
    bptt: int = 35
    # "fp32" or "bf16" (tfpar contenders only; the Keras baseline stays fp32).
    precision: str = "fp32"
    # Optimizer of every contender, tfpar and Keras alike: "sgd" (as in ptb_word_lm.py's
    # small configuration) or "adam" (tfpar's default).
    optimizer: str = "sgd"
    # Interleaved rounds; in each, every contender trains `steps` timed steps.
    rounds: int = 5
    steps: int = 40
    # Untimed steps per contender before the first round: tracing (stream mode traces
    # twice: the first window starts from no state, the second from a carried one).
    warmup: int = 3
    # Generated corpus size when `data` is "synthetic" (train sentences).
    synthetic_sentences: int = 20000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "embed_dim", "hidden_dim", "batch_size", "bptt", "rounds",
                     "steps", "synthetic_sentences"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got "
                                  f"{getattr(self, name)}")
        if self.warmup < 2:
            raise ConfigError(f"warmup must be >= 2 (the first two steps trace), got {self.warmup}")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"unknown precision {self.precision!r}; expected fp32 or bf16")
        if self.optimizer not in ("sgd", "adam"):
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; expected sgd or adam")


def quick_spec(**overrides) -> BenchSpec:
    """``--quick``: enough rounds for stable medians, a few minutes on 2 cores."""
    return BenchSpec(**{"rounds": 3, "steps": 20, **overrides})


def tiny_spec(**overrides) -> BenchSpec:
    """``--tiny``: a generated corpus and a toy model; runs in seconds (for tests)."""
    return BenchSpec(**{
        "data": "synthetic", "layers": 1, "embed_dim": 16, "hidden_dim": 16,
        "vocab_size": 0, "batch_size": 8, "bptt": 10, "rounds": 1, "steps": 3, "warmup": 2,
        "synthetic_sentences": 300, **overrides})


# ----------------------------------------------------------------------------- pure parts
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


def check_targets(results: dict[str, Any]) -> list[tuple[str, Any, str, float, bool]]:
    """``(name, value, comparison, threshold, passed)`` for every target in TARGETS;
    a missing value fails."""
    rows = []
    for name, (op, threshold) in TARGETS.items():
        value = results.get(name)
        ok = isinstance(value, (int, float)) and math.isfinite(value) and (
            value >= threshold if op == ">=" else value <= threshold)
        rows.append((name, value, op, threshold, ok))
    return rows


def fixed_windows(stream: np.ndarray, bptt: int) -> tuple[np.ndarray, np.ndarray]:
    """A token stream cut into non-overlapping windows, the way the Keras guides feed
    ``model.fit``: inputs [N, bptt] and the next tokens as targets [N, bptt]."""
    n = (len(stream) - 1) // bptt
    x = stream[: n * bptt].reshape(n, bptt)
    y = stream[1: n * bptt + 1].reshape(n, bptt)
    return x, y


# ----------------------------------------------------------------------------- contenders
@dataclasses.dataclass
class Segment:
    """What ``n`` timed training steps took."""

    tokens: float  # real target tokens trained on
    seconds: float  # wall time
    cpu_seconds: float  # CPU time of the whole process (every thread) in that wall time
    wait_seconds: float = 0.0  # of `seconds`, the time spent getting the batches


class Contender:
    """Something that trains: ``segment(n)`` runs ``n`` timed steps."""

    name = ""

    def warm_up(self, steps: int) -> None:
        self.segment(steps)

    def segment(self, steps: int) -> Segment:
        raise NotImplementedError


def _optimizer(name: str):
    import keras

    return keras.optimizers.SGD(1.0) if name == "sgd" else keras.optimizers.Adam(3e-3)


class TfparContender(Contender):
    """tfpar's training step under one plug-in, fed from tf.data or from memory."""

    def __init__(self, name: str, plugin, model, optimizer, train_step, batches, *,
                 stream: bool):
        self.name, self.plugin, self.model = name, plugin, model
        self.optimizer, self.train_step = optimizer, train_step
        self.batches = batches  # an iterator (tf.data) or a list (in memory)
        self.stream = stream
        self.state = None
        self._next = 0

    def _batch(self):
        if isinstance(self.batches, list):
            batch = self.batches[self._next % len(self.batches)]
            self._next += 1
            return batch
        return next(self.batches)

    def step(self) -> Segment:
        """One training step, including the wait for its batch."""
        start, cpu = time.perf_counter(), time.process_time()
        batch = self._batch()
        fetched = time.perf_counter()
        out = self.train_step(batch, self.state) if self.stream else self.train_step(batch)
        self.state = out.state if self.stream else None
        # The training loop reads these after every step too (a sync point).
        tokens = float(out.count)
        float(out.nll_sum), float(out.grad_norm)
        return Segment(tokens, time.perf_counter() - start, time.process_time() - cpu,
                       fetched - start)

    def segment(self, steps: int) -> Segment:
        parts = [self.step() for _ in range(steps)]
        return Segment(*(sum(getattr(p, f.name) for p in parts)
                         for f in dataclasses.fields(Segment)))


class KerasContender(Contender):
    """The plain-Keras baseline: ``keras.Sequential`` + ``compile`` + ``fit``."""

    name = "keras_baseline"

    def __init__(self, spec: BenchSpec, vocab_size: int, x: np.ndarray, y: np.ndarray):
        import keras

        keras.utils.set_random_seed(spec.seed)
        self.model = keras.Sequential([
            keras.Input((spec.bptt,), dtype="int32"),
            keras.layers.Embedding(vocab_size, spec.embed_dim),
            *[keras.layers.LSTM(spec.hidden_dim, return_sequences=True)
              for _ in range(spec.layers)],
            keras.layers.Dense(vocab_size),
        ])
        self.model.compile(optimizer=_optimizer(spec.optimizer),
                           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self.x, self.y, self.batch_size = x, y, spec.batch_size
        self._next = 0

    def segment(self, steps: int) -> Segment:
        """One ``fit`` call over ``steps + 1`` batches, timed from the end of its first
        batch to the end of its last (so ``fit``'s own start-up is not counted)."""
        import keras

        ends: list[tuple[float, float]] = []

        class Clock(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                ends.append((time.perf_counter(), time.process_time()))

        rows = (steps + 1) * self.batch_size
        if self._next + rows > len(self.x):
            self._next = 0
        x = self.x[self._next:self._next + rows]
        y = self.y[self._next:self._next + rows]
        self._next += rows
        self.model.fit(x, y, batch_size=self.batch_size, epochs=1, verbose=0,
                       callbacks=[Clock()])
        tokens = float(np.count_nonzero(y[self.batch_size:]))
        return Segment(tokens, ends[-1][0] - ends[0][0], ends[-1][1] - ends[0][1])


# ----------------------------------------------------------------------------- set-up
@dataclasses.dataclass
class Setup:
    spec: BenchSpec
    corpus_name: str
    corpus_note: str
    splits: dict
    vocab: Any
    stream_data: Any  # InputData in stream mode
    sentence_data: Any  # InputData in sentence mode


def load_setup(spec: BenchSpec) -> Setup:
    """Reads (or generates) the corpus and builds the vocabulary and the input data."""
    from tfpar.config import DataConfig
    from tfpar.data.sources import load_corpus
    from tfpar.data.pipeline import InputData
    from tfpar.data.vocab import Vocab

    note = ""
    source = spec.data
    if source != "synthetic" and not os.path.isdir(source):
        note = f"PTB not found at {source}: using the generated (synthetic) corpus instead"
        log.warning("%s", note)
        source = "synthetic"
    data_config = DataConfig(source=source, mode="stream", bptt=spec.bptt,
                             synthetic_train=spec.synthetic_sentences,
                             synthetic_valid=max(1, spec.synthetic_sentences // 10),
                             synthetic_test=max(1, spec.synthetic_sentences // 10))
    corpus = load_corpus(data_config, seed=spec.seed)
    vocab = Vocab.build(corpus.splits["train"], max_size=spec.vocab_size)
    stream = InputData(corpus.splits, vocab, data_config, seed=spec.seed)
    sentence = InputData(corpus.splits, vocab, dataclasses.replace(data_config, mode="sentence"),
                         seed=spec.seed)
    return Setup(spec, corpus.name, note, corpus.splits, vocab, stream, sentence)


def model_config(spec: BenchSpec):
    from tfpar.config import ModelConfig

    return ModelConfig(layers=spec.layers, embed_dim=spec.embed_dim, hidden_dim=spec.hidden_dim,
                       precision=spec.precision)


def build_tfpar(setup: Setup, name: str, dist) -> tuple[TfparContender, Any]:
    """A tfpar contender under the plug-in ``dist`` names (clip 5, tfpar's default), and
    the plug-in."""
    from tfpar.model.lm import build_model
    from tfpar.parallel import build_strategy

    spec = setup.spec
    plugin = build_strategy(dist)
    with plugin.scope():
        model = build_model(model_config(spec), len(setup.vocab), seed=spec.seed)
        optimizer = _optimizer(spec.optimizer)
        optimizer.build(model.trainable_variables)
    train_step = plugin.make_train_step(model, optimizer, clip_norm=5.0)
    data = setup.stream_data
    batches = iter(plugin.distribute(
        lambda ctx: data.batches("train", training=True, input_context=ctx,
                                 batch_size=spec.batch_size).repeat()))
    return TfparContender(name, plugin, model, optimizer, train_step, batches,
                          stream=True), plugin


def in_memory_twin(contender: TfparContender, steps: int) -> TfparContender:
    """The same model and step fed from ``steps`` batches already in memory (taken from
    the contender's own pipeline, so shapes and contents are the same)."""
    batches = [next(contender.batches) for _ in range(steps)]
    return TfparContender(contender.name + "_memory", contender.plugin, contender.model,
                          contender.optimizer, contender.train_step, batches, stream=True)


def keras_baseline(setup: Setup) -> KerasContender:
    from tfpar.data.pipeline import stream_ids

    stream = stream_ids(setup.splits["train"], setup.vocab).numpy()
    x, y = fixed_windows(stream, setup.spec.bptt)
    return KerasContender(setup.spec, len(setup.vocab), x, y)


# Contenders on two logical CPU devices: they run in a process of their own, set up the way
# scripts/train.py sets up such a run (its intra-op thread share; tfpar.parallel.devices).
TWO_DEVICE = ("mirrored2", "tower2", "pipeline2")


def distribution_configs() -> dict[str, Any]:
    """name -> DistConfig, or NOT_AVAILABLE when the strategy is not registered."""
    from tfpar.config import DistConfig
    from tfpar.parallel import STRATEGIES

    two = ("/cpu:0", "/cpu:1")
    wanted = {
        "default": DistConfig(strategy="default"),
        "mirrored1": DistConfig(strategy="mirrored", devices=("/cpu:0",)),
        "mirrored2": DistConfig(strategy="mirrored", devices=two),
        "tower2": DistConfig(strategy="tower", devices=two),
        "pipeline2": DistConfig(strategy="pipeline", cpu_devices=2),
    }
    return {k: (v if v.strategy in STRATEGIES else NOT_AVAILABLE) for k, v in wanted.items()}


def build_available(setup: Setup, names: Sequence[str], warmup: int
                    ) -> tuple[dict[str, TfparContender], dict[str, str]]:
    """Builds and warms up the named tfpar contenders; a strategy that fails is reported
    (name -> "failed: ..." or NOT_AVAILABLE) instead of sinking the rest."""
    built, failed = {}, {}
    configs = distribution_configs()
    for name in names:
        dist = configs[name]
        if dist == NOT_AVAILABLE:
            failed[name] = NOT_AVAILABLE
            continue
        try:
            contender, _ = build_tfpar(setup, name, dist)
            contender.warm_up(warmup)  # traces: a broken strategy fails here
        except Exception as e:  # a strategy under construction must not sink the rest
            log.warning("%s failed: %s", name, e)
            failed[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        built[name] = contender
    return built, failed


class RemoteContender(Contender):
    """A contender that lives in a child process (its own TF runtime: logical devices and
    thread pools); ``segment`` asks it to train and waits, so timings stay interleaved
    with the parent's contenders."""

    def __init__(self, name: str, server: "ContenderServer"):
        self.name, self.server = name, server

    def segment(self, steps: int) -> Segment:
        return Segment(**self.server.ask({"name": self.name, "steps": steps}))


class ContenderServer:
    """``python -m tfpar.tools.benchmark --serve``: a child process hosting some contenders."""

    def __init__(self, spec: BenchSpec, names: Sequence[str]):
        import subprocess

        request = json.dumps({"spec": dataclasses.asdict(spec), "names": list(names)})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tfpar.tools.benchmark", "--serve", request],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        ready = self._read()
        self.status: dict[str, str] = ready["status"]  # name -> "ok" | "failed: ..."

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark child process exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def contenders(self) -> dict[str, RemoteContender]:
        return {n: RemoteContender(n, self) for n, s in self.status.items() if s == "ok"}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def serve(request: str) -> int:
    """The child side of :class:`ContenderServer`: sets up its runtime as
    ``scripts/train.py`` would for two logical CPU devices, builds the contenders, then
    answers ``{"name", "steps"}`` requests with a Segment, one JSON line each."""
    from tfpar.tools.cli import prepare_runtime
    from tfpar.config import DistConfig

    out = os.fdopen(os.dup(1), "w")  # the protocol's channel; anything else printed -> stderr
    os.dup2(2, 1)
    req = json.loads(request)
    spec = BenchSpec(**req["spec"])
    prepare_runtime(DistConfig(strategy="mirrored", cpu_devices=2))  # train.py's own set-up
    built, failed = build_available(load_setup(spec), req["names"], spec.warmup)
    out.write(json.dumps({"status": {**failed, **{n: "ok" for n in built}}}) + "\n")
    out.flush()
    for line in sys.stdin:
        ask = json.loads(line)
        out.write(json.dumps(dataclasses.asdict(built[ask["name"]].segment(ask["steps"])))
                  + "\n")
        out.flush()
    return 0


# ----------------------------------------------------------------------------- measuring
def interleave(contenders: list[Contender], spec: BenchSpec) -> dict[str, dict[str, float]]:
    """Runs every contender ``spec.rounds`` times for ``spec.steps`` steps, round-robin
    with the order rotated each round.

    Returns:
      name -> medians over rounds of ``tokens_per_sec`` (wall), ``step_seconds`` and
      ``tokens_per_cpu_sec`` (tokens per second of process CPU time: less sensitive to
      other processes on a busy host, though it counts spinning worker threads too).
    """
    segments: dict[str, list[Segment]] = {c.name: [] for c in contenders}
    for r in range(spec.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            segments[c.name].append(c.segment(spec.steps))
        log.info("round %d/%d: %s", r + 1, spec.rounds, ", ".join(
            f"{n} {s[-1].tokens / s[-1].seconds:.0f}" for n, s in segments.items()))
    return {n: {
        "tokens_per_sec": float(np.median([s.tokens / s.seconds for s in segs])),
        "step_seconds": float(np.median([s.seconds / spec.steps for s in segs])),
        "tokens_per_cpu_sec": float(np.median([s.tokens / s.cpu_seconds for s in segs])),
    } for n, segs in segments.items()}


def paired_steps(a: TfparContender, b: TfparContender, pairs: int
                 ) -> list[tuple[Segment, Segment]]:
    """``pairs`` pairs of back-to-back steps of ``a`` and ``b`` (the order alternates): the
    finest A/B pairing, so a change of load hits both sides."""
    out = []
    for i in range(pairs):
        if i % 2:
            tb, ta = b.step(), a.step()
        else:
            ta, tb = a.step(), b.step()
        out.append((ta, tb))
    return out


def paired_step_ratios(a: TfparContender, b: TfparContender, pairs: int) -> list[float]:
    """``a``'s step time over ``b``'s, for each of :func:`paired_steps`."""
    return [ta.seconds / tb.seconds for ta, tb in paired_steps(a, b, pairs)]


def input_wait_fraction(pairs: list[tuple[Segment, Segment]]) -> float:
    """Share of the tf.data-fed steps (second of each pair) spent getting their batch,
    beyond what the in-memory steps (first) spend: what the input pipeline adds to a
    step, timed directly rather than as the difference of two noisy step times."""
    extra = sum(tf_step.wait_seconds - mem.wait_seconds for mem, tf_step in pairs)
    return max(0.0, extra / sum(tf_step.seconds for _, tf_step in pairs))


def paired_segment_rates(a: Contender, b: Contender, spec: BenchSpec
                         ) -> tuple[list[float], list[float]]:
    """Tokens/s of ``a`` and ``b`` in ``spec.rounds`` pairs of back-to-back segments of
    ``spec.steps`` steps (the order alternates)."""
    rates_a, rates_b = [], []
    for r in range(spec.rounds):
        order = (a, b) if r % 2 == 0 else (b, a)
        got = {id(c): c.segment(spec.steps) for c in order}
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


def run(spec: BenchSpec) -> dict[str, Any]:
    """Every measurement; returns the results dict that goes to ``--json``."""
    started = time.time()
    load_before = os.getloadavg()
    setup = load_setup(spec)
    results: dict[str, Any] = {
        "spec": dataclasses.asdict(spec), "corpus": setup.corpus_name,
        "corpus_note": setup.corpus_note, "vocab_size": len(setup.vocab),
        "cpu_count": os.cpu_count(),
    }
    results.update(padding(setup))

    keras_contender = keras_baseline(setup)
    local_names = [n for n in distribution_configs() if n not in TWO_DEVICE]
    tfpar, distribution = build_available(setup, local_names, spec.warmup)
    if "default" not in tfpar:
        raise RuntimeError(f"tfpar's default strategy failed: {distribution['default']}")
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
    memory = in_memory_twin(default, spec.steps)
    # Warm every local contender again once all exist: building a strategy drops compiled
    # (XLA) kernels of the ones built before it.
    for contender in contenders:
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


# ----------------------------------------------------------------------------- reporting
def format_report(results: dict[str, Any]) -> str:
    """The human-readable summary the script prints."""
    def num(v, fmt="{:,.0f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else str(v)

    spec = results["spec"]
    lines = [
        f"corpus {results['corpus']} (vocab {results['vocab_size']}), {spec['layers']}-layer LSTM "
        f"{spec['embed_dim']}/{spec['hidden_dim']}, batch {spec['batch_size']}, bptt "
        f"{spec['bptt']}, stream mode, {spec['precision']}, {spec['optimizer']}; "
        f"{spec['rounds']} rounds x "
        f"{spec['steps']} steps",
    ]
    if results["corpus_note"]:
        lines.append(f"note: {results['corpus_note']}")
    cpu = results["tokens_per_cpu_sec"]
    lines.append(f"{'contender':<22}{'tokens/s':>12}{'vs default':>12}{'tokens/cpu-s':>14}")
    keras_side = results["side_by_side_tokens_per_sec"].get("keras_baseline")
    lines.append(f"{'keras_baseline':<22}{num(keras_side):>12}"
                 f"{'':>12}{num(cpu.get('keras_baseline')):>14}")
    for name, value in results["distribution_tokens_per_sec"].items():
        rel = results["distribution_vs_default"][name]
        rel = num(rel, "{:.3f}") if isinstance(rel, float) else ""
        lines.append(f"{name:<22}{num(value):>12}{rel:>12}{num(cpu.get(name, '')):>14}")
    for name in ("mirrored", "default"):
        if f"tfpar_{name}_tokens_per_sec" not in results:
            continue
        lines.append(
            f"{'headline' if name == results['tfpar_strategy'] else 'also'}: tfpar {name} "
            f"{num(results[f'tfpar_{name}_tokens_per_sec'])} tokens/s = "
            f"{results[f'tfpar_{name}_vs_keras_baseline']:.3f} x Keras (per round: "
            + ", ".join(f"{x:.2f}" for x in results[f"tfpar_{name}_vs_keras_baseline_per_round"])
            + ")")
    lines.append(f"Keras baseline {num(results['keras_baseline_tokens_per_sec'])} tokens/s; "
                 f"headline ratio in tokens per CPU-second: "
                 f"{num(results['tfpar_vs_keras_baseline_cpu'], '{:.3f}')}")
    lines.append(f"input stall: {results['input_stall_fraction']:.4f} of a step waiting for "
                 f"tf.data (whole-step A/B against batches in memory: "
                 f"{results['input_stall_fraction_ab']:.4f})")
    lines.append(f"pad fraction: bucketed {results['pad_fraction_bucketed']:.4f}, plain padded_batch "
                 f"{results['pad_fraction_naive']:.4f} ({results['bucket_count']} buckets)")
    la = (results["load_average_before"], results["load_average_after"])
    lines.append(f"load average {la[0]:.2f} -> {la[1]:.2f}"
                 + ("  (busy host: timings are noisy)" if max(la) > 1.5 else ""))
    for name, t in results["targets"].items():
        lines.append(f"{'PASS' if t['pass'] else 'FAIL'} {name} = "
                     f"{num(t['value'], '{:.4f}')} (target {t['target']})")
    return "\n".join(lines)


def write_json(path: str, results: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, sort_keys=True)


def write_plot(path: str, results: dict[str, Any]) -> None:
    """Bar charts of tokens/s and of the stall and pad shares, as a PNG.

    Raises:
      ConfigError: matplotlib is not installed (it is the optional ``bench`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed; install the extra with "
            "pip install -e '.[bench]' or leave out --plot") from None
    keras_rate = results["side_by_side_tokens_per_sec"]["keras_baseline"]
    names = ["keras_baseline"] + list(results["distribution_tokens_per_sec"])
    values = [keras_rate] + [
        v if isinstance(v, float) else 0.0 for v in results["distribution_tokens_per_sec"].values()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    bars = a.bar(names, values, color=["grey"] + ["tab:blue"] * (len(names) - 1))
    for bar, v, name in zip(bars, values, names):
        label = f"{v:,.0f}" if v else "n/a"
        a.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center",
               va="bottom", fontsize=8)
    a.axhline(1.4 * keras_rate, color="tab:red", ls="--", lw=1,
              label="1.4 x Keras baseline (target)")
    a.set_ylabel("training tokens/s")
    a.set_title(f"{results['corpus']}: {results['spec']['layers']}x{results['spec']['hidden_dim']} "
                f"LSTM, batch {results['spec']['batch_size']}, bptt {results['spec']['bptt']}; "
                f"side by side (headline pairs: {results['tfpar_vs_keras_baseline']:.2f} x Keras)",
                fontsize=9)
    a.tick_params(axis="x", labelrotation=20, labelsize=8)
    a.legend(fontsize=8)
    shares = {"input stall": results["input_stall_fraction"] or 0.0,
              "pad (bucketed)": results["pad_fraction_bucketed"],
              "pad (padded_batch)": results["pad_fraction_naive"]}
    b.bar(list(shares), list(shares.values()), color=["tab:green", "tab:blue", "grey"])
    for i, v in enumerate(shares.values()):
        b.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    b.set_ylim(0, max(0.1, max(shares.values()) * 1.15))
    b.set_ylabel("share of step time / of tokens")
    b.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmark.py",
        description="Training throughput of tfpar against plain Keras, the input pipeline's "
                    "share, padding, and the cost of distribution, measured side by side.")
    p.add_argument("--data", default=DEFAULT_PTB,
                   help="PTB folder, or 'synthetic' (default: %(default)s; falls back to the "
                        "generated corpus when it is missing)")
    p.add_argument("--quick", action="store_true", help="fewer rounds (a few minutes)")
    p.add_argument("--tiny", action="store_true",
                   help="a generated corpus and a toy model: seconds (for tests)")
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds (0: by mode)")
    p.add_argument("--steps", type=int, default=0, help="timed steps per segment (0: by mode)")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 for the tfpar contenders")
    p.add_argument("--optimizer", default="sgd",
                   help="sgd | adam, for every contender (default: %(default)s, as in "
                        "ptb_word_lm.py's small configuration)")
    p.add_argument("--json", default="", help="write the results to this JSON file")
    p.add_argument("--plot", default="", help="write a PNG chart here (needs matplotlib)")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("-v", "--verbose", action="store_true", help="TensorFlow's own logs too")
    p.add_argument("--serve", default="", help=argparse.SUPPRESS)  # child process (internal)
    return p


def spec_from_args(a: argparse.Namespace) -> BenchSpec:
    overrides: dict[str, Any] = {"precision": a.precision, "optimizer": a.optimizer}
    if a.rounds:
        overrides["rounds"] = a.rounds
    if a.steps:
        overrides["steps"] = a.steps
    if a.tiny:
        return tiny_spec(**overrides)
    overrides["data"] = a.data
    return quick_spec(**overrides) if a.quick else BenchSpec(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/benchmark.py``: exit 0, or 1 under ``--check`` when a target is missed,
    2 on a usage error."""
    from tfpar.tools.cli import run_main, setup_logging

    args = parser().parse_args(argv)
    setup_logging(args.verbose)
    if args.serve:
        return serve(args.serve)

    def body():
        spec = spec_from_args(args)
        from tfpar.parallel import devices

        devices.configure_cpu_devices(1)  # the 2-device contenders run in a child process
        results = run(spec)
        print(format_report(results))
        if args.json:
            write_json(args.json, results)
        if args.plot:
            write_plot(args.plot, results)
        missed = [n for n, t in results["targets"].items() if not t["pass"]]
        return 1 if args.check and missed else 0

    return run_main(body)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
