"""The contenders: what trains and is timed, how each is built, and how one fails."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterator, Sequence

import numpy as np

from tfpar.tools.bench.spec import NOT_AVAILABLE, BenchSpec
from tfpar.tools.bench.workload import Setup, fixed_windows, model_config

log = logging.getLogger("tfpar.tools.bench")


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


def describe(error: BaseException) -> str:
    """``"ValueError: first line of the message"`` (at most 200 characters of it)."""
    first = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:200]}"


class ContenderFailed(RuntimeError):
    """A contender crashed; the message is one line: ``contender <name> failed: <why>``."""

    def __init__(self, name: str, reason: BaseException | str):
        self.name = name
        self.reason = reason if isinstance(reason, str) else describe(reason)
        super().__init__(f"contender {name} failed: {self.reason}")


def _optimizer(name: str):
    import keras

    return keras.optimizers.SGD(1.0) if name == "sgd" else keras.optimizers.Adam(3e-3)


class TfparContender(Contender):
    """tfpar's training step under one plug-in, fed from tf.data or from memory."""

    def __init__(self, name: str, plugin, model, optimizer, train_step, batches, *,
                 stream: bool):
        from tfpar.training.runner import run_steps

        self.name, self.plugin, self.model = name, plugin, model
        self.optimizer, self.train_step = optimizer, train_step
        self.batches = batches  # an iterator (tf.data) or a list (in memory)
        self.stream = stream
        self._next = 0
        self._fetched = 0.0  # when the last batch was in hand (perf_counter)
        # One step per next(); run_steps carries the stream state from window to window.
        self._outputs = run_steps(train_step, self._timed_batches(), stream=stream)

    def _batch(self):
        if isinstance(self.batches, list):
            batch = self.batches[self._next % len(self.batches)]
            self._next += 1
            return batch
        return next(self.batches)

    def _timed_batches(self) -> Iterator:
        while True:
            try:
                batch = self._batch()
            except StopIteration:
                return
            self._fetched = time.perf_counter()
            yield batch

    def step(self) -> Segment:
        """One training step, including the wait for its batch."""
        start, cpu = time.perf_counter(), time.process_time()
        out = next(self._outputs)  # gets the batch (sets self._fetched), then steps
        # The training loop reads these after every step too (a sync point).
        tokens = float(out.count)
        float(out.nll_sum), float(out.grad_norm)
        return Segment(tokens, time.perf_counter() - start, time.process_time() - cpu,
                       self._fetched - start)

    def segment(self, steps: int) -> Segment:
        parts = [self.step() for _ in range(steps)]
        return Segment(*(sum(getattr(p, f.name) for p in parts)
                         for f in dataclasses.fields(Segment)))


class MultiStepContender(Contender):
    """tfpar's ``--steps-per-execution n``: ``n`` training steps per ``tf.function`` call
    (``tfpar.training.runner.make_train_steps``), reading the plug-in's distributed
    iterator inside the call; the stream state is carried from call to call."""

    def __init__(self, name: str, plugin, model, optimizer, one_step, batches, n: int):
        from tfpar.training.runner import make_train_steps

        self.name, self.n, self.batches = name, n, batches
        self.steps = make_train_steps(plugin, model, optimizer, clip_norm=5.0)
        self.state = one_step(next(batches), None).state  # a stream's first window

    def segment(self, steps: int) -> Segment:
        """``steps`` steps (a multiple of ``n`` is timed exactly; the last call is cut)."""
        start, cpu = time.perf_counter(), time.process_time()
        tokens, done = 0.0, 0
        while done < steps:
            call = self.steps(self.batches, self.state, min(self.n, steps - done))
            self.state = call.state
            tokens += sum(float(out.count) for out in call.outputs)
            done += len(call.outputs)
        return Segment(tokens, time.perf_counter() - start, time.process_time() - cpu)


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


# ----------------------------------------------------------------------------- builders
# The host-overhead probe's model: the step's call path (plug-in, iterator, tf.function,
# the loss read back) around almost no compute.
PROBE_MODEL = {"layers": 1, "embed_dim": 16, "hidden_dim": 16}


def build_tfpar(setup: Setup, name: str, dist, *, precision: str | None = None,
                steps_per_execution: int = 1, probe: bool = False, fused: bool = True
                ) -> tuple[Contender, Any]:
    """A tfpar contender under the plug-in ``dist`` names (clip 5, tfpar's default), and
    the plug-in; ``precision`` overrides the spec's, ``steps_per_execution > 1`` makes a
    :class:`MultiStepContender`, ``probe`` trains :data:`PROBE_MODEL` instead, ``fused``
    False computes the logits, then the cross-entropy (``--no-fused-softmax``)."""
    from tfpar.objective.step import make_train_step
    from tfpar.parallel.registry import build_strategy
    from tfpar.parallel.rows import replica_batches
    from tfpar.training.state import build_train_state

    spec = setup.spec
    model_spec = dataclasses.replace(spec, **PROBE_MODEL) if probe else spec
    model = model_config(model_spec, precision, fused=fused)
    plugin = build_strategy(dist, model)  # placed for this model, as training places it
    state = build_train_state(plugin.scope(), model,
                              len(setup.vocab),
                              seed=spec.seed,
                              make_optimizer=lambda epoch, lr_scale: _optimizer(spec.optimizer))
    train_step = make_train_step(plugin, state.model, state.optimizer, clip_norm=5.0)
    data = setup.stream_data
    batches = iter(plugin.distribute(
        lambda ctx: replica_batches(data, "train", training=True, input_context=ctx,
                                    batch_size=spec.batch_size).repeat()))
    if steps_per_execution > 1:
        return MultiStepContender(name, plugin, state.model, state.optimizer, train_step,
                                  batches, steps_per_execution), plugin
    return TfparContender(name, plugin, state.model, state.optimizer, train_step, batches,
                          stream=True), plugin


def in_memory_twin(contender: TfparContender, steps: int) -> TfparContender:
    """The same model and step fed from ``steps`` batches already in memory (taken from
    the contender's own pipeline, so shapes and contents are the same)."""
    batches = [next(contender.batches) for _ in range(steps)]
    return TfparContender(contender.name + "_memory", contender.plugin, contender.model,
                          contender.optimizer, contender.train_step, batches, stream=True)


def keras_baseline(setup: Setup) -> KerasContender:
    stream = setup.vocab_ids("train")
    x, y = fixed_windows(stream, setup.spec.bptt)
    return KerasContender(setup.spec, len(setup.vocab), x, y)


# Contenders on two logical CPU devices: they run in a process of their own, set up the way
# scripts/train.py sets up such a run (its intra-op thread share; tfpar.parallel.devices).
TWO_DEVICE = ("mirrored2", "tower2", "pipeline2")


def distribution_configs() -> dict[str, Any]:
    """name -> DistConfig, or NOT_AVAILABLE when the strategy is not registered."""
    from tfpar.config import DistConfig
    from tfpar.parallel.registry import STRATEGIES

    two = ("/cpu:0", "/cpu:1")
    wanted = {
        "default": DistConfig(strategy="default"),
        "mirrored1": DistConfig(strategy="mirrored", devices=("/cpu:0",)),
        "mirrored2": DistConfig(strategy="mirrored", devices=two),
        "tower2": DistConfig(strategy="tower", devices=two),
        "pipeline2": DistConfig(strategy="pipeline", cpu_devices=2),
    }
    return {k: (v if v.strategy in STRATEGIES else NOT_AVAILABLE) for k, v in wanted.items()}


# The same step with one thing changed, on no strategy: the other precision, ten steps
# per call, the unfused full softmax (--no-fused-softmax). name -> keyword arguments of
# build_tfpar.
SPE = 10


def variant_configs(spec: BenchSpec) -> dict[str, dict[str, Any]]:
    other = "bf16" if spec.precision == "fp32" else "fp32"
    return {f"default_{other}": {"precision": other},
            f"default_spe{SPE}": {"steps_per_execution": SPE},
            "default_unfused": {"fused": False}}


def build_available(setup: Setup, names: Sequence[str], warmup: int
                    ) -> tuple[dict[str, Contender], dict[str, str]]:
    """Builds and warms up the named tfpar contenders (strategies, or
    :func:`variant_configs` of the default one); one that fails is reported
    (name -> "failed: ..." or NOT_AVAILABLE) instead of sinking the rest. The run still
    fails in the end: :func:`tfpar.tools.bench.report.failed_contenders` finds it."""
    built, failed = {}, {}
    configs, variants = distribution_configs(), variant_configs(setup.spec)
    for name in names:
        options = variants.get(name, {})
        dist = configs["default" if name in variants else name]
        if dist == NOT_AVAILABLE:
            failed[name] = NOT_AVAILABLE
            continue
        try:
            contender, _ = build_tfpar(setup, name, dist, **options)
            contender.warm_up(warmup)  # traces: a broken strategy fails here
        except Exception as e:  # a strategy under construction must not sink the rest
            log.warning("%s failed: %s", name, e)
            failed[name] = f"failed: {describe(e)}"
            continue
        built[name] = contender
    return built, failed
