"""Pipeline model parallelism (GPipe): the model's stages on their devices, micro-batched.

TF1's ``device_guard`` pipeline (PaddlePaddle's guide: the data and embedding layers on
the CPU, the rest on a GPU, a mini-batch cut into micro-batches so the devices work at the
same time), ported to TF 2 without ``tf.distribute``. The stages come from ``--stages``
(:mod:`tfpar.parallel.pipeline.stages`): runs of consecutive model parts on one device. A
part's weights live on its stage's device, and so do its forward ops and their gradient
ops.

One training step (GPipe: synchronous, the update equals one device's on the whole
batch). The global batch is cut into M micro-batches of rows (``tfpar.parallel.rows``:
sizes differ by at most one; an empty one is a padding row). Stage k runs micro-batch j as soon as
stage k-1 has handed it the activations of j, so while stage k+1 works on j, stage k
already works on j+1. Backward runs the other way, micro-batch by micro-batch, each stage
differentiating its own forward (one ``GradientTape`` per stage and micro-batch) given the
gradient of its output from the stage after it. Picture for S = 2 stages, M = 4
(Fj/Bj: forward/backward of micro-batch j; one slot per unit of work)::

    time ->                 0    1    2    3    4    5    6    7    8    9
    stage 0 (/cpu:0)       F0   F1   F2   F3   ..   ..   B3   B2   B1   B0 | sum the M gradients
      embedding, rnn_0                                                     | of every weight on
    stage 1 (/cpu:1)       ..   F0   F1   F2   F3   B3   B2   B1   B0   .. | its device, clip by
      rnn_1, softmax            ^ stage 1 on F0 while stage 0 runs F1      | the global norm,
                                                                           | apply once
    bubble: each stage idles (S-1) of its (M+S-1) forward slots and as many backward ones,
    a fraction (S-1)/(M+S-1) of the step: 1/2 at M=1, 1/3 at M=2, 1/5 at M=4, 1/9 at M=8.

The picture is GPipe's order, not a constraint: the step is one ``tf.function`` whose only
edges between (stage, micro-batch) pieces are the data they pass (``tests/test_pipeline.py``
checks the traced graph for any other), and TensorFlow's executor runs whatever piece has
its inputs on an idle inter-op thread. A profile shows it taking micro-batches out of
order and starting B_j as soon as F_j is done on every later stage (a 1F1B-like order);
the sums of the gradients do not depend on the order. Overlap needs 2+ inter-op threads
(``tf.config.threading``; TF's default is one per core); ``tests/bench_pipeline.py``
(in a clone) measures it.

The loss of micro-batch j is ``nll_sum_j / N`` with N the real-token count of the whole
global batch, so the sum of the micro-batches' gradients is the whole batch's gradient.
Clipping comes after that sum, and the Keras optimizer (outside any ``tf.distribute``
strategy) applies it once; its update ops are colocated with the variables, i.e. on the
stages' devices. In stream mode the recurrent state is split into rows like the batch and
the final states are concatenated back, so windows carry state exactly as on one device.
With dropout on, each micro-batch's rows draw the masks one device draws for them
(``tfpar.model.noise``), so the update stays one device's.

Ops are named ``stage_<k>/forward_mb_<j>/…``, ``gradient_tape/stage_<k>/forward_mb_<j>/…``
and ``stage_<k>/backward_mb_<j>/…`` (its gradient), ``stage_<k>/accumulate``, so the
overlap can be read off a TensorBoard trace (``--profile-steps``: the trace viewer's
``tf_Compute`` threads) and the placement checked on the traced graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import tensorflow as tf

from tfpar import compat
from tfpar.objective import step
from tfpar.config import DistConfig, ModelConfig
from tfpar.model.lm import EMBEDDING, SOFTMAX, rnn_name
from tfpar.parallel import devices as devices_lib
from tfpar.parallel.base import Parts, StrategyPlugin, parts_of
from tfpar.parallel.rows import join, shard_bounds, shard_rows, state_rows
from tfpar.parallel.pipeline.stages import (RNN_PART, Placement, Stage, part_of_path,
                                            placement_from_config)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _MicroBatch:
    """Rows ``start:start+size`` of the global batch (one padding row when size is 0)."""

    inputs: tf.Tensor  # [b, T] int32
    targets: tf.Tensor  # [b, T] int32
    start: tf.Tensor  # int32 scalar
    size: tf.Tensor  # int32 scalar
    rows: tf.Tensor  # [b] int32, the rows' indices in the global batch (dropout masks)


class PipelinePlugin(StrategyPlugin):
    """Stages of the model on their devices, M micro-batches per step (GPipe)."""

    name = "pipeline"

    def __init__(self, placement: Placement, micro_batches: int):
        self.placement = placement
        self.micro_batches = micro_batches
        self._stages: list[Stage] | None = None
        # Per bound model: each stage's weights, and id(weight) -> the stage that sums
        # its gradient (the first that uses it: the tied softmax uses the embedding).
        self._stage_vars: list[list] = []
        self._owner: dict[int, int] = {}

    @property
    def num_replicas(self) -> int:
        return 1  # Model parallel: the whole global batch flows through every stage.

    @property
    def devices(self) -> list[str]:
        if self._stages is not None:
            return list(dict.fromkeys(s.device for s in self._stages))
        if self.placement.spec is not None:
            return list(dict.fromkeys(self.placement.spec.values()))
        host = self.placement.host if self.placement.host and not self.placement.tied else ""
        return ([host] if host else []) + self.placement.compute

    @property
    def stages(self) -> list[Stage]:
        if self._stages is None:
            raise RuntimeError("the pipeline has no model yet: make a step first")
        return self._stages

    def describe(self) -> str:
        return (f"pipeline: {self.placement.describe()}; {self.micro_batches} "
                f"micro-batch(es) per global batch")

    def scope(self):
        """Every weight of a model part is created on that part's device (Adam's slots
        follow: Keras colocates them with their weight)."""
        return tf.variable_creator_scope(self._create_variable)

    def _create_variable(self, next_creator, **kwargs):
        part = part_of_path(compat.creating_keras_variable_path())
        device = self.placement.device_of(part) if part else None
        if device is None:
            return next_creator(**kwargs)
        with tf.device(device):
            return next_creator(**kwargs)

    def distribute(self, dataset_fn):
        """Global batches: the step cuts them into micro-batches itself."""
        return dataset_fn(None)

    def bind(self, model) -> list[Stage]:
        """Resolves the stages for ``model`` (checks ``--stages`` against its layers)."""
        stages = self.placement.stages(model.config.layers)
        if stages != self._stages:
            self._stages = stages
            for s in stages:
                log.info("pipeline stage %d on %s: %s", s.index, s.device, ", ".join(s.parts))
            for v in model.variables:
                part = part_of_path(v.path)
                want = self.placement.device_of(part) if part else None
                if want and not devices_lib.same_device(v.value.device, want):
                    log.warning("weight %s lives on %s, not on its stage's %s (created "
                                "outside the plug-in's scope?): read across devices",
                                v.path, v.value.device, want)
        self._stage_vars = [_stage_variables(model, s) for s in stages]
        self._owner = _owners(model, self._stage_vars)
        return stages

    # ------------------------------------------------------------------ step pieces
    def replicate(self, fn, batch, state):
        """One data-parallel replica (the whole global batch flows through every stage):
        ``fn`` on the last stage, where the loss uses what it computes (the step's token
        count)."""
        last = self.stages[-1]
        with tf.device(last.device), tf.name_scope("global_count"):
            out = fn(batch, state)
        return parts_of([out], last.device, "global_count")

    def gradient_pieces(self, model, loss, batch, state, global_count):
        """Forward wavefront, backward wavefront; each weight's gradient from every piece
        that uses it, summed on its stage (the owner: the first stage that uses it)."""
        mbs = self._split(batch)
        outs, tapes = self._forward_all(model, loss, mbs,
                                        self._split_state(model, state, mbs), global_count)
        grads = self._backward_all(outs, tapes, self._stage_vars)
        pieces = []
        for v in model.trainable_variables:
            stage = self.stages[self._owner[id(v)]]
            pieces.append(Parts(grads[id(v)], stage.device, f"{stage.scope}/accumulate"))
        return pieces, self._last(outs, "nll"), self._join_state(model, outs, mbs, detach=True)

    def norm(self, grads, variables):
        """One partial sum of squares per stage (one scalar leaves it), their root on the
        first stage."""
        partials = []
        for s in self.stages:
            mine = [g for g, v in zip(grads, variables) if self._owner[id(v)] == s.index]
            if mine:
                with tf.device(s.device), tf.name_scope(f"{s.scope}/accumulate"):
                    partials.append(tf.add_n([step.squared_norm(g) for g in mine]))
        with tf.device(self.stages[0].device), tf.name_scope("global_norm"):
            return tf.sqrt(tf.add_n(partials))

    def run_update(self, optimizer, update, grads):
        """TF runs each weight's update where the weight lives."""
        with tf.name_scope("update"):
            update(grads)

    @contextlib.contextmanager
    def place_update(self, variable):
        """A weight's gradient is scaled on its own stage."""
        stage = self.stages[self._owner[id(variable)]]
        with tf.device(stage.device), tf.name_scope(f"{stage.scope}/clip"):
            yield

    def loss_pieces(self, model, loss, batch, state):
        mbs = self._split(batch)
        outs, _ = self._forward_all(model, loss, mbs, self._split_state(model, state, mbs),
                                    None)
        return (self._last(outs, "nll"), self._last(outs, "count"),
                self._join_state(model, outs, mbs, detach=False))

    def schedule(self) -> list[tuple[Stage, int]]:
        """(stage, micro-batch) in wavefront order: at tick t, stage k runs micro-batch
        t - k. Only the order the graph is built in: the data decide what runs when."""
        m, stages = self.micro_batches, self.stages
        return [(s, t - s.index) for t in range(len(stages) + m - 1) for s in stages
                if 0 <= t - s.index < m]

    def _forward_all(self, model, loss, mbs, states, global_count):
        """Every stage on every micro-batch; in training (``global_count`` given), each
        piece on its own tape, watching the activations it received.

        Returns:
          ``(outs, tapes)`` keyed by (stage index, micro-batch); ``tapes`` maps to
          ``(tape, activations received or None)``.
        """
        outs, tapes = {}, {}
        for s, j in self.schedule():
            x_in = outs[s.index - 1, j]["x"] if s.index else None
            if global_count is None:
                outs[s.index, j] = self._forward(model, loss, s, j, mbs[j], x_in, states,
                                                 None)
                continue
            with tf.GradientTape() as tape:
                if x_in is not None:
                    tape.watch(x_in[0])
                outs[s.index, j] = self._forward(model, loss, s, j, mbs[j], x_in, states,
                                                 global_count)
            tapes[s.index, j] = (tape, x_in)
        return outs, tapes

    def _backward_all(self, outs: dict, tapes: dict, stage_vars: list[list]) -> dict:
        """Backward wavefront, the other way round: each piece differentiates its own
        forward, the last stage its loss, the others their output given the gradient the
        stage after them sent back. The tape's gradient ops are built inside the stage's
        device scope, so they run where their forward ops ran.

        Returns:
          {id(weight): [its gradient from every piece that uses it]}.
        """
        grads = {id(v): [] for vs in stage_vars for v in vs}
        upstream = {}  # (stage, micro-batch) -> gradient of that piece's output.
        last = len(self.stages) - 1
        for s, j in reversed(self.schedule()):
            tape, x_in = tapes.pop((s.index, j))
            sources = ([x_in[0]] if x_in is not None else []) + stage_vars[s.index]
            with tf.device(s.device), tf.name_scope(f"{s.scope}/backward_mb_{j}"):
                if s.index == last:
                    g = tape.gradient(outs[s.index, j]["loss"], sources)
                else:
                    g = tape.gradient(outs[s.index, j]["x"][0], sources,
                                      output_gradients=upstream.pop((s.index, j)))
            if x_in is not None:
                upstream[s.index - 1, j] = g[0]
                g = g[1:]
            for v, gv in zip(stage_vars[s.index], g):
                grads[id(v)].append(gv)
        return grads

    def _last(self, outs: dict, key: str) -> Parts:
        """The last stage's ``key`` ("nll", "count") of every micro-batch, summed there."""
        last = self.stages[-1]
        return Parts([outs[last.index, j][key] for j in range(self.micro_batches)],
                     last.device, f"sum_{key}")

    # ---------------------------------------------------------------- stage pieces
    def _forward(self, model, loss, stage: Stage, j: int, mb: _MicroBatch, x_in, states,
                 global_count) -> dict:
        """Stage ``stage`` on micro-batch ``j``; in training (``global_count`` given)
        with dropout and the loss training differentiates (``loss.train_nll``).

        Args:
          x_in: ``(activations [b, T, D], mask [b, T])`` from the stage before, or None
            for the first stage (which starts with the embedding).
          states: {layer: that layer's initial state rows of every micro-batch} or None.
          global_count: real tokens of the whole global batch (train) or None (eval).

        Returns:
          {"x": (activations, mask)} for the next stage; the last stage adds "nll",
          "count" and, in training, "loss" = nll / global_count; {"finals": {layer: state}}.
        """
        out: dict = {"finals": {}}
        training = global_count is not None
        with tf.device(stage.device), tf.name_scope(f"{stage.scope}/forward_mb_{j}"):
            x, mask = x_in if x_in is not None else (None, None)
            for part in stage.parts:
                if part == EMBEDDING:
                    x, mask = model.embed(mb.inputs, training=training, rows=mb.rows)
                elif part == SOFTMAX and training:
                    # The sampled softmax: every micro-batch draws the step's candidates.
                    nll, count = loss.train_nll(model, x, mb.targets)
                    out.update(nll=nll, count=count,
                               loss=step.differentiated(model, nll, global_count))
                elif part == SOFTMAX:
                    out["nll"], out["count"] = loss.nll(model, x, mb.targets)
                else:
                    i = int(RNN_PART.match(part).group(1))
                    initial = None if states is None else states[i][j]
                    x, out["finals"][i] = model.run_rnn(i, x, mask, initial, training=training,
                                                        rows=mb.rows)
            out["x"] = (x, mask)
        return out

    def _split(self, batch: dict) -> list[_MicroBatch]:
        """The M micro-batches, cut on the first stage's device (which reads the ids)."""
        with tf.device(self.stages[0].device), tf.name_scope("split"):
            rows = tf.shape(batch["targets"])[0]
            out = []
            for j in range(self.micro_batches):
                start, size = shard_bounds(rows, self.micro_batches, j)
                part = shard_rows(batch, self.micro_batches, j)
                out.append(_MicroBatch(part["inputs"], part["targets"], start, size,
                                       part["rows"]))
            return out

    def _split_state(self, model, state, mbs: list[_MicroBatch]):
        """{layer i: [rows of micro-batch j]} of the [B, H] state, on layer i's device."""
        if state is None:
            return None
        out = {}
        for i in range(model.config.layers):
            with tf.device(self.placement.device_of(rnn_name(i))), \
                    tf.name_scope(f"split_state_{i}"):
                out[i] = [[state_rows(s, mb.start, mb.size) for s in state[i]] for mb in mbs]
        return out

    def _join_state(self, model, outs: dict, mbs: list[_MicroBatch], *, detach: bool):
        """The final states of every layer, micro-batches concatenated back to [B, H]
        (returned in sentence mode too, like the other strategies; the loop drops them)."""
        joined = []
        for i in range(model.config.layers):
            stage = next(s for s in self.stages if rnn_name(i) in s.parts)
            with tf.device(stage.device), tf.name_scope(f"join_state_{i}"):
                finals = [outs[stage.index, j]["finals"][i] for j in range(len(mbs))]
                layer = [join([f[n] for f in finals], [mb.size for mb in mbs])
                         for n in range(len(finals[0]))]
            joined.append(step.detach_state(layer) if detach else layer)
        return joined


def _stage_variables(model, stage: Stage) -> list:
    """The trainable weights a stage's parts use (the tied softmax uses the embedding)."""
    layers = {EMBEDDING: model.embedding, SOFTMAX: model.softmax}
    out, seen = [], set()
    for part in stage.parts:
        layer = layers.get(part) or getattr(model, part)
        for v in layer.trainable_variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _owners(model, stage_vars: list[list]) -> dict[int, int]:
    """id(weight) → the first stage that uses it (where its gradient is summed)."""
    owner: dict[int, int] = {}
    for k, vs in enumerate(stage_vars):
        for v in vs:
            owner.setdefault(id(v), k)
    missing = [v.path for v in model.trainable_variables if id(v) not in owner]
    if missing:
        raise ValueError(f"weights outside every pipeline stage: {', '.join(missing)}")
    return owner


def build_pipeline(dist: DistConfig, model: ModelConfig | None = None) -> PipelinePlugin:
    """Stages from ``--stages`` (or the default rule), ``--micro-batches`` per batch, for
    ``model`` (None: untied): the placement is decided here, before any variable exists
    or anything is logged, and never changes (the default rule keeps a tied embedding
    with the softmax).

    Raises:
      ConfigError: a malformed ``--stages`` or one combined with ``--devices``.
      DeviceError: a stage device that does not exist on this host.
    """
    tied = model is not None and model.tie_embeddings
    placement = placement_from_config(dist, tied=tied)
    if tied and placement.spec is not None and \
            placement.device_of(EMBEDDING) != placement.device_of(SOFTMAX):
        log.warning("--stages puts the tied embedding (%s) and the softmax (%s) on "
                    "different devices: the softmax reads the table across devices "
                    "every micro-batch", placement.device_of(EMBEDDING),
                    placement.device_of(SOFTMAX))
    return PipelinePlugin(placement, dist.micro_batches)
