"""The training step, written once: what a replica computes and the one update.

Every strategy runs these functions; a strategy contributes only *placement* (where each
replica's rows run) and *aggregation* (how the replicas' gradients become one)::

    global batch [B, T] --(placement: the strategy splits rows)--> replica r: rows b_r
    replica r     nll_r, n_r = loss(model(b_r))                     (forward)
                  N = n_0 + ... + n_{R-1}                           (token count, summed)
                  g_r = d(nll_r / N) / d(theta)                     (replica_gradients)
    aggregation   g = g_0 + ... + g_{R-1}                           (the strategy's reduce)
    update        |g| = global norm;  c = clip / max(|g|, clip)     (here, once)
                  if |g| and the loss are finite: theta <- optimizer(c * g)
                  else: nothing changes

With ``--softmax sampled`` the embedding's and the softmax's gradients are
``tf.IndexedSlices`` (the rows a step touched) all the way: summed as gathers of rows
(:func:`add_gradients`), repeated rows summed once (:func:`deduplicate`) before the norm,
clipped by scaling their values (:func:`scale`) and applied sparsely by the optimizer; the
candidates are drawn from (seed, step), the same on every replica
(``tfpar.objective.output.SampledSoftmax``).

Because each replica differentiates ``nll_r / N`` with ``N`` the *global* count, the plain
sum of the replicas' gradients is the gradient one device computes on the whole batch,
however unevenly the real tokens are spread. Clipping uses the norm of that sum, which is
what one device clips by, and a non-finite norm skips the whole update (weights, optimizer
slots and the step counter stay bit-identical), so a bad batch never reaches the weights
under any strategy; the loop then stops or goes on, per ``--on-nan``.

A strategy plug-in (``tfpar.parallel.base.StrategyPlugin``) only places; this module
composes (:func:`aggregate`, :func:`evaluate`, :func:`one_update`), so the token count, the
gradient sum, the norm, the clip, the finite guard and the update are each written once
here. The plug-in offers:

* ``replicate(fn, batch, state)``: ``fn(rows, state rows)`` on every replica's rows, on
  its device, the outputs in the plug-in's per-replica form (``gradient_pieces`` and
  ``loss_pieces``, by default ``replicate`` of :func:`replica_gradients` and
  :func:`forward`, are where the pipeline's micro-batch schedule comes in instead);
* ``sum(values)``: each scalar's sum over the replicas; ``sum_gradients(grads,
  variables, combine)``: each gradient's, ``combine`` (this module's) giving it the form
  the update takes where the plug-in adds (``tf.distribute``, the tower ring: their
  all-reduce adds, then ``combine`` on the result);
* ``norm(grads, variables)``: where the global norm of the sum is taken;
* ``join_states(finals)``: the replicas' final states as one carried state;
* ``run_update(optimizer, update, grads)``: runs the step's update (:func:`apply_scaled`,
  ``factor * grads`` applied once) where the plug-in's update belongs, and
  ``place_update(variable)``, where each gradient is scaled.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from tfpar import compat
from tfpar.model import precision, xla
from tfpar.objective import losses
from tfpar.objective.output import output_loss


@dataclasses.dataclass
class StepOutput:
    """What a train or eval step reports (scalars already summed over replicas)."""

    nll_sum: tf.Tensor
    count: tf.Tensor
    grad_norm: tf.Tensor | None = None
    # The recurrent state to feed to the next window (stream mode), in the strategy's own
    # form (a tensor structure, or per-replica values); None in sentence mode.
    state: Any = None
    # A train step's outcome (None for an eval step), from :func:`update`, the one place
    # finiteness is decided: ``applied``, the update reached the weights (the step
    # counts); ``scale_skipped``, not applied because the loss-scaled gradient overflowed
    # (--precision mixed_float16; the forward pass, hence the state, was finite). Neither:
    # a non-finite batch, for the loop's --on-nan policy.
    applied: Any = None
    scale_skipped: Any = None


@dataclasses.dataclass
class Aggregated:
    """The summed gradient of one step, before the update (:func:`aggregate`).

    ``grads`` is the sum over the replicas, one per trainable variable (dense, or with
    the sampled softmax a deduplicated ``tf.IndexedSlices``), in the form the same
    plug-in's ``run_update`` hands the update: tensors (hand-placed plug-ins), or every
    replica's copy of the sum (``tf.distribute``). ``norm`` is its global norm.
    """

    grads: Any
    norm: tf.Tensor  # float32 scalar
    nll_sum: tf.Tensor  # float32 scalar, summed over replicas
    count: tf.Tensor  # float32 scalar, real target tokens of the global batch
    state: Any = None  # final recurrent state (already cut from the gradient tape)


def as_step_output(step_fn, *, any_shape: bool = False):
    """Wraps a ``tf.function`` that returns a dict of StepOutput fields (tf.function cannot
    return a dataclass) so callers get a :class:`StepOutput`. The wrapped function stays
    reachable as ``.function`` (graph inspection in tests).

    ``any_shape`` (sentence mode, whose batches vary in shape): the first call traces the
    function for every shape of its arguments (:func:`any_shape_specs`), the one trace
    every later batch runs. Left to ``reduce_retracing``, the first batch would get a trace
    of its own exact shapes and the second a shape-relaxed one: the step's graph built
    twice, for the same ops (the model forgets static shapes in sentence mode).
    """

    def step(batch, state=None):
        if any_shape and not step_fn.experimental_get_tracing_count():
            step_fn.get_concrete_function(*any_shape_specs((batch, state)))
        return StepOutput(**step_fn(batch, state))

    step.function = step_fn
    return step


def any_shape_specs(values):
    """The type specs of ``values`` (a structure of tensors, distributed values or None)
    with every dimension unknown: [b, T] -> [None, None]."""
    # TypeSpec's rank-only relaxation (what reduce_retracing's later traces get) reaches
    # into composite specs too: a PerReplica's is one spec per replica.
    return tf.nest.map_structure(lambda v: None if v is None else compat.rank_only_spec(v),
                                 values)


def forward(model, batch: dict, state=None, *, loss):
    """Runs the model on one batch, without dropout, and scores it with the full softmax
    (evaluation; training's loss is :func:`training_loss`).

    Args:
      batch: {"inputs": [b, T] int32, "targets": [b, T] int32}, and "rows" [b] int32
        (the rows' indices in the global batch, which key the dropout masks) when the
        rows are a replica's share (``tfpar.parallel.rows``), at least one row.
      state: initial recurrent state (one list of [b, H] tensors per layer) or None.
      loss: the output loss (``tfpar.objective.output``).

    Returns:
      ``(nll_sum, count, final_state)``, float32 scalars and the state structure.
    """
    x, final = model.features(batch["inputs"], initial_state=state, training=False,
                              rows=batch.get("rows"))
    nll_sum, count = loss.nll(model, x, batch["targets"])
    return nll_sum, count, final


def training_loss(model, batch: dict, state=None, training: bool = True, *, loss):
    """What training differentiates: ``loss.train_nll`` (the full softmax's, or the
    sampled softmax's estimate); arguments and result as :func:`forward`, ``training``
    only switches dropout."""
    x, final = model.features(batch["inputs"], initial_state=state, training=training,
                              rows=batch.get("rows"))
    nll_sum, count = loss.train_nll(model, x, batch["targets"])
    return nll_sum, count, final


def differentiated(model, nll_sum: tf.Tensor, global_count: tf.Tensor) -> tf.Tensor:
    """What every replica (and pipeline micro-batch) differentiates: ``nll_sum /
    global_count``, times the loss scale under ``--precision mixed_float16`` (then the
    gradients are scaled too, and :func:`update` divides their sum by the scale)."""
    loss = nll_sum / global_count
    scale_loss = getattr(model, "scale_loss", None)
    return loss if scale_loss is None else scale_loss(loss)


def replica_gradients(model, batch: dict, global_count: tf.Tensor, state=None, *, loss,
                      training: bool = True, variables: Sequence | None = None):
    """One replica's share: gradients of ``nll_sum / global_count`` on its rows.

    Args:
      model: the Keras model.
      batch: {"inputs": [b, T], "targets": [b, T]}, this replica's rows.
      global_count: real target tokens in the whole global batch (all replicas).
      state: initial recurrent state or None.
      loss: the output loss (``tfpar.objective.output``).
      training: dropout on.
      variables: what to differentiate (default: ``model.trainable_variables``).

    Returns:
      ``(grads, nll_sum, count, final_state)``: one gradient per variable (dense, or with
      the sampled softmax the embedding's and the softmax's as ``tf.IndexedSlices``
      [rows, D] with repeated rows), and the final state cut from the tape (truncated
      BPTT: the next window starts there).
    """
    variables = model.trainable_variables if variables is None else variables
    with tf.GradientTape() as tape:
        nll_sum, count, final = training_loss(model, batch, state, training, loss=loss)
        objective = differentiated(model, nll_sum, tf.maximum(global_count, 1.0))
    grads = tape.gradient(objective, variables)
    if not loss.sparse_gradients:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
    return grads, nll_sum, count, detach_state(final)


# -- gradients that may be tf.IndexedSlices: what every plug-in's aggregation and apply use
def add_gradients(parts: Sequence) -> Any:
    """The sum of one variable's gradients from several replicas (or micro-batches).

    Dense: ``tf.add_n``. ``tf.IndexedSlices``: their rows concatenated (what
    ``tf.distribute`` does with them: a gather, not a dense [V, D] sum), repeated rows
    left to :func:`deduplicate`. Mixed (a tied embedding in the pipeline: the softmax's
    dense gradient, the embedding's rows): the rows concatenated and made dense once,
    plus the dense parts.
    """
    parts = list(parts)
    sparse = [g for g in parts if isinstance(g, tf.IndexedSlices)]
    dense = [g for g in parts if not isinstance(g, tf.IndexedSlices)]
    if not sparse:
        return add(dense)
    rows = tf.IndexedSlices(tf.concat([g.values for g in sparse], 0),
                            tf.concat([tf.cast(g.indices, tf.int64) for g in sparse], 0),
                            sparse[0].dense_shape)
    if not dense:
        return rows
    return tf.add_n([tf.convert_to_tensor(rows)] + dense)


def combine_gradients(loss) -> Callable[[Sequence], Any]:
    """``combine(parts)``: one variable's summed gradient, as the update takes it (the
    one gradient sum of the synchronous step; plug-ins run it where they sum).

    With the sampled softmax (``loss.sparse_gradients``) a ``tf.IndexedSlices`` keeps its
    rows, each row once (:func:`deduplicate`); otherwise the sum is made dense (the
    embedding's rows, once for all the parts)."""
    sparse = loss.sparse_gradients

    def combine(parts):
        total = add_gradients(parts)
        if sparse:
            return deduplicate(total)
        return tf.convert_to_tensor(total) if isinstance(total, tf.IndexedSlices) else total

    return combine


def add(parts: Sequence) -> tf.Tensor:
    """Dense parts summed: ``combine`` for scalars (losses, token counts), and the dense
    case of :func:`add_gradients`."""
    parts = list(parts)
    return tf.add_n(parts) if len(parts) > 1 else parts[0]


def deduplicate(grad):
    """A ``tf.IndexedSlices`` with every row once (repeated rows summed); other
    gradients unchanged. Needed before the norm (``tf.linalg.global_norm`` squares the
    rows as given: two halves of one row count less than the row) and before optimizers
    that square the gradient (Adagrad)."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    rows, index = tf.unique(tf.cast(grad.indices, tf.int64), out_idx=tf.int64)
    values = tf.math.unsorted_segment_sum(grad.values, index, tf.size(rows, out_type=tf.int64))
    return tf.IndexedSlices(values, rows, grad.dense_shape)


def scale(grad, factor: tf.Tensor):
    """``factor * grad``; a ``tf.IndexedSlices`` keeps its rows (only ``values`` scale)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


def squared_norm(grad) -> tf.Tensor:
    """``|grad|^2`` (a deduplicated ``tf.IndexedSlices``: of its rows)."""
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    return tf.reduce_sum(tf.square(values))


def detach_state(state):
    """Stops gradients flowing into the previous window (truncated BPTT)."""
    return None if state is None else tf.nest.map_structure(tf.stop_gradient, state)


def clip_factor(global_norm: tf.Tensor, clip_norm: float) -> tf.Tensor:
    """The factor ``tf.clip_by_global_norm`` would apply: ``c / max(norm, c)`` (1 if c=0)."""
    if not clip_norm:
        return tf.constant(1.0)
    return clip_norm / tf.maximum(global_norm, clip_norm)


def update(norm: tf.Tensor, nll_sum: tf.Tensor, clip_norm: float,
           apply: Callable[[tf.Tensor], Any], loss_scale: tf.Tensor | None = None
           ) -> tuple[tf.Tensor, tf.Tensor]:
    """The update: ``apply(clip factor)`` when the step is finite, nothing otherwise.

    A step is finite when both the aggregated gradient's norm and the summed loss are:
    the loop reports a step with either one inf/NaN as "not applied", so neither may
    reach the weights (an overflowing loss can come with a finite gradient).

    With loss scaling (``loss_scale``, the ``LossScaleOptimizer``'s current scale, which
    ``apply`` then goes through) the gradient is the scaled one: the clip factor comes
    from ``norm / loss_scale``, and the optimizer divides by the scale as it applies. A
    finite loss with an overflowing scaled gradient is a loss-scale skip: ``apply(NaN)``
    hands every replica non-finite gradients, so Keras' optimizer halves the scale and
    skips the step on all of them alike (its finiteness check is per replica).

    Args:
      norm: global norm of the aggregated (scaled) gradient.
      nll_sum: the batch's summed loss (all replicas).
      clip_norm: ``--clip-norm`` (0: no clipping).
      apply: applies ``factor * gradient`` once (the plug-in's ``run_update`` of
        :func:`apply_scaled`).
      loss_scale: the loss scale, or None without loss scaling.

    Returns:
      ``(applied, scale_skipped)``, bool scalars: the update was applied; it was a
      loss-scale skip (always False without loss scaling).
    """
    true_norm = norm if loss_scale is None else norm / loss_scale
    factor = clip_factor(true_norm, clip_norm)

    def applied():
        apply(factor)
        return tf.constant(True)

    def not_applied():
        return tf.constant(False)

    def scale_skip():
        apply(tf.constant(float("nan")))
        return tf.constant(False)

    # The condition sits outside any replica context: under tf.distribute a
    # synchronisation point (the optimizer's all-reduce) may not live in replica control
    # flow, so the plug-in's run_update calls strategy.run inside this branch.
    finite = tf.logical_and(tf.math.is_finite(norm), tf.math.is_finite(nll_sum))
    if loss_scale is None:
        return tf.cond(finite, applied, not_applied), tf.constant(False)
    overflow = tf.logical_and(tf.math.is_finite(nll_sum),
                              tf.logical_not(tf.math.is_finite(norm)))
    return (tf.cond(finite, applied, lambda: tf.cond(overflow, scale_skip, not_applied)),
            overflow)


def apply_scaled(optimizer, variables, grads, factor: tf.Tensor,
                 place: Callable[[Any], Any] | None = None) -> None:
    """The update of every synchronous step: ``factor * grads`` applied by ``optimizer``
    once (the only ``apply_gradients`` of the synchronous path).

    Args:
      optimizer: the Keras optimizer (or its ``LossScaleOptimizer``).
      variables: the trainable variables, in ``grads``' order.
      grads: one gradient per variable (dense, or a deduplicated ``tf.IndexedSlices``).
      factor: float32 scalar, the clip factor (NaN: a loss-scale skip, see :func:`update`).
      place: ``place(variable)``, the context each gradient is scaled in (the plug-in's
        ``place_update``); None: where this is called.
    """
    scaled = []
    for g, v in zip(grads, variables):
        with place(v) if place is not None else contextlib.nullcontext():
            scaled.append(scale(g, factor))
    optimizer.apply_gradients(zip(scaled, variables))


def aggregate(plugin, model, loss, batch, state) -> Aggregated:
    """The gradient half of every synchronous step: token count, each replica's
    gradients, their sum and its norm, placed by ``plugin``.

    Args:
      plugin: the strategy (its ``replicate``, ``gradient_pieces``, ``sum``,
        ``sum_gradients``, ``norm`` and ``join_states``).
      model: the model.
      batch: what the plug-in's ``distribute`` yields: {"inputs", "targets"} [B, T].
      state: the carried recurrent state in the plug-in's form, or None.

    Returns:
      :class:`Aggregated`: the summed gradients, their global norm, the summed loss, the
      global token count and the final state (the plug-in's form).
    """
    with tf.name_scope("token_count"):  # the replicas' name scopes stay their gradients'
        counts = plugin.replicate(lambda rows, _: losses.token_count(rows["targets"]),
                                  batch, None)
        count = plugin.sum(counts)
    grads, nll, final = plugin.gradient_pieces(model, loss, batch, state,
                                               tf.maximum(count, 1.0))
    grads = plugin.sum_gradients(grads, model.trainable_variables, combine_gradients(loss))
    return Aggregated(grads=grads, norm=plugin.norm(grads, model.trainable_variables),
                      nll_sum=plugin.sum(nll), count=count,
                      state=plugin.join_states(final))


def evaluate(plugin, model, loss, batch, state) -> tuple[tf.Tensor, tf.Tensor, Any]:
    """``(nll_sum, count, final_state)`` of the whole batch without gradients: each
    replica's :func:`forward` (the plug-in's ``loss_pieces``), summed."""
    nll, count, final = plugin.loss_pieces(model, loss, batch, state)
    return plugin.sum(nll), plugin.sum(count), plugin.join_states(final)


def one_update(plugin, model, optimizer, *, clip_norm: float, loss):
    """``update(batch, state) -> StepOutput``: the body of every synchronous train step
    (traced into the runner's multi-step loop, ``tfpar.training.runner.make_train_steps``,
    or into :func:`make_train_step`'s function); the output's ``grad_norm`` is the true
    gradient's (unscaled) and ``applied`` / ``scale_skipped`` say what :func:`update` did."""
    plugin.bind(model)
    key_noise_by_step(model, optimizer)
    scale = use_loss_scaling(model, optimizer)

    def one(batch, state):
        # Fixed shapes (stream mode: two window shapes an epoch): the step's parts run
        # XLA-compiled whether or not the trace sees the shape (a strategy's slices, a
        # multi-step loop's reads hide it), so every step of every strategy and of every
        # --steps-per-execution runs the same kernels.
        with xla.compile_any_shape() if model.fixed_shapes else contextlib.nullcontext():
            agg = aggregate(plugin, model, loss, batch, state)
        variables = model.trainable_variables
        applied, scale_skipped = update(
            agg.norm, agg.nll_sum, clip_norm,
            lambda factor: plugin.run_update(
                optimizer, lambda grads: apply_scaled(optimizer, variables, grads, factor,
                                                      plugin.place_update), agg.grads),
            loss_scale=scale)
        # Reported: the norm of the true gradient.
        norm = agg.norm if scale is None else agg.norm / scale
        return StepOutput(nll_sum=agg.nll_sum, count=agg.count, grad_norm=norm,
                          state=agg.state, applied=applied, scale_skipped=scale_skipped)

    return one


def key_noise_by_step(model, optimizer) -> None:
    """Keys the model's dropout masks and sampled-softmax candidates by the optimizer's
    step (``tfpar.model.noise``): the same on every replica and worker, and a resumed run
    draws what an uninterrupted one did. Every train step (synchronous or the parameter
    server's) sets it here."""
    model.noise.step = lambda: optimizer.iterations


def use_loss_scaling(model, optimizer):
    """With a ``LossScaleOptimizer``: makes :func:`differentiated` scale the model's loss
    by it and returns its scale variable; otherwise None (and the loss is not scaled)."""
    scale = precision.loss_scale(optimizer)
    # A plain function attribute: Keras does not track it as a weight.
    model.scale_loss = optimizer.scale_loss if scale is not None else None
    return scale


def make_train_step(plugin, model, optimizer, *, clip_norm: float, loss=None):
    """``step(batch, state=None) -> StepOutput``: one update of ``model`` under ``plugin``.

    Args:
      plugin: the strategy (its placement, see the module docstring).
      model: the model, built in the plug-in's scope.
      optimizer: the Keras optimizer, built in the same scope.
      clip_norm: clip the aggregated gradient to this global norm (0: no clipping).
      loss: the output loss (``tfpar.objective.output``; None: the one ``model``'s
        config names, ``output_loss(model.config)``).
    """
    one = one_update(plugin, model, optimizer, clip_norm=clip_norm,
                     loss=loss or output_loss(model.config))

    @tf.function(autograph=False, reduce_retracing=True)
    def train_step(batch, state=None):
        out = one(batch, state)  # (a tf.function returns a dict, not a dataclass)
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}

    return as_step_output(train_step, any_shape=not model.fixed_shapes)


def make_eval_step(plugin, model, loss=None):
    """``step(batch, state=None) -> StepOutput`` without gradients (``grad_norm`` None);
    ``loss`` as for :func:`make_train_step` (evaluation scores the full softmax).
    ``step.zero_state(rows)``: the zero state of a ``rows``-row global batch in the
    plug-in's form, where stream-mode evaluation starts."""
    plugin.bind(model)
    loss = loss or output_loss(model.config)

    @tf.function(autograph=False, reduce_retracing=True)
    def eval_step(batch, state=None):
        nll_sum, count, final = evaluate(plugin, model, loss, batch, state)
        return dict(nll_sum=nll_sum, count=count, state=final)

    step_fn = as_step_output(eval_step, any_shape=not model.fixed_shapes)
    # Stream mode's first window starts from these zeros, not from None: one structure
    # for every window, so the first is not traced apart from the rest.
    step_fn.zero_state = lambda rows: zero_state(plugin, model, rows)
    return step_fn


def zero_state(plugin, model, rows: int):
    """The zero recurrent state of a ``rows``-row global batch in ``plugin``'s form: where
    an epoch's first stream window starts (evaluation's, verify's training's)."""
    return plugin.local_state(model.zero_state(rows))
