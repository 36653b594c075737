"""Every data-parallel plug-in computes what one device computes.

Same initial weights, same global batches (bucketed, variable-length: replicas hold
unequal token counts, and 10 rows do not split evenly over 3 replicas), dropout off, SGD
with momentum (its slots are compared like the weights), equivalence.STEPS steps, and
verify's automatic clip norm (the median of the first steps' gradient norms), so some
steps are clipped after aggregation and some are not (asserted): on a clipped step a
gradient off by a constant factor gives the same update, on an unclipped one not. In
stream mode the state carried out of the last window is compared too.
"""

import functools

import pytest

from conftest import make_lines, max_diff, model_config
from equivalence import assert_equivalent, auto_clip_norm, make_setup, run_with_state
from tfpar.config import DataConfig, DistConfig
from tfpar.data.pipeline import InputData
from tfpar.model.lm import build_model
from tfpar.parallel.registry import build_strategy
from tfpar.training.loop import evaluate
from tfpar.tools.verify import Setup, run_pipeline, run_plugin
from tfpar.data.vocab import Vocab
from tfpar.objective.step import make_eval_step

MODEL = model_config(embed_dim=16, hidden_dim=16)
BATCH = 10
CPU = tuple(f"/device:CPU:{i}" for i in range(4))


@functools.lru_cache(maxsize=None)
def setup(mode):
    """The data, initial weights and (automatic) clip norm of every run of one mode."""
    lines = make_lines(160, seed=0)
    data = InputData({"train": lines, "valid": make_lines(30, seed=1), "test": lines[:5]},
                     Vocab.build(lines), DataConfig(mode=mode, bptt=6, max_length=20), seed=1)
    return make_setup(data, MODEL, mode, batch_size=BATCH)


def dist_config(strategy, replicas):
    if strategy == "default":
        return DistConfig()
    return DistConfig(strategy=strategy, devices=CPU[:replicas])


@functools.lru_cache(maxsize=None)
def run(strategy, replicas, mode):
    """STEPS steps from the shared weights, and the state carried out of the last window."""
    return run_with_state(run_plugin, setup(mode), dist_config(strategy, replicas))


@pytest.mark.parametrize("mode", ["sentence", "stream"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_mirrored_matches_default_with_clipping(replicas, mode):
    """Norms, weights, momentum slots, (stream) the carried state gathered from the
    replicas, and the eval of the trained weights, distributed like training. (tower
    and parallel_do: test_tower, test_parallel_do.)"""
    ref, got = run("default", 1, mode), run("mirrored", replicas, mode)
    assert max_diff(ref.result.slots[2:], [0 * w for w in ref.result.weights]) > 1e-3  # Momentum.
    assert_equivalent(got, ref, setup(mode))


@pytest.mark.parametrize("mode", ["sentence", "stream"])
@pytest.mark.parametrize("strategy,replicas", [("mirrored", 2), ("mirrored", 3), ("tower", 3)])
def test_distributed_eval_equals_single_device_eval(strategy, replicas, mode):
    """The same weights give the same (nll, count) over the whole valid split."""
    s = setup(mode)
    results = []
    for dist in (DistConfig(), dist_config(strategy, replicas)):
        plugin = build_strategy(dist)
        with plugin.scope():
            model = build_model(MODEL, len(s.data.vocab), seed=0)
            model.set_weights(s.initial_weights)
        results.append(evaluate(plugin, make_eval_step(plugin, model), s.data, "valid", BATCH))
    (ref_nll, ref_count), (nll, count) = results
    assert count == ref_count > 0
    assert nll == pytest.approx(ref_nll, rel=1e-6)


@functools.lru_cache(maxsize=None)
def sampled_setup(mode, tie):
    """``setup(mode)`` with the sampled softmax (8 candidates of 43 words), tied or not;
    the clip norm is the median of the first steps' gradient norms, as verify picks it."""
    import dataclasses

    base = setup(mode)
    config = dataclasses.replace(MODEL, softmax="sampled", num_sampled=8, tie_embeddings=tie)
    weights = build_model(config, len(base.data.vocab), seed=0).get_weights()
    clip = auto_clip_norm(config, base.data, weights, BATCH, base.spec.steps)
    return Setup(base.spec, base.data, config, weights, clip, clip_norm_auto=True)


@functools.lru_cache(maxsize=None)
def run_sampled(strategy, replicas, mode, tie):
    s = sampled_setup(mode, tie)
    if strategy == "pipeline":  # stages on `replicas` devices, 3 micro-batches
        return run_with_state(run_pipeline, s, replicas)
    return run_with_state(run_plugin, s, dist_config(strategy, replicas))


@pytest.mark.parametrize("strategy,replicas,mode,tie", [
    ("mirrored", 2, "sentence", False), ("tower", 3, "stream", True),
    ("pipeline", 2, "sentence", True)])
def test_sampled_softmax_matches_default(strategy, replicas, mode, tie):
    """--softmax sampled: every replica (and micro-batch) draws the step's candidates
    from (seed, step), so N devices give one device's update, sparse gradients and all."""
    ref = run_sampled("default", 1, mode, tie)
    got = run_sampled(strategy, replicas, mode, tie)
    # Norms, weights, slots, (stream) the carried state; eval: the full softmax, distributed.
    assert_equivalent(got, ref, sampled_setup(mode, tie))


# ----------------------------------------------------------------- the plug-in contract
@pytest.mark.parametrize("dist", [
    DistConfig(), DistConfig(strategy="mirrored", devices=CPU[:2]),
    DistConfig(strategy="tower", devices=CPU[:2]),
    DistConfig(strategy="tower", devices=CPU[:2], tower_reduce="ring"),
    DistConfig(strategy="parallel_do", devices=CPU[:2]),
    DistConfig(strategy="pipeline", stages="embedding=/cpu:0,rnn=/cpu:1,softmax=/cpu:1"),
], ids=["default", "mirrored", "tower", "tower_ring", "parallel_do", "pipeline"])
def test_every_plug_in_gives_every_summed_gradient_the_steps_form(dist, monkeypatch):
    """``sum_gradients``' contract: each variable's summed gradient goes through the step's
    ``combine`` (the form the update takes), whether the plug-in adds the replicas' parts
    itself or its all-reduce does (``tf.distribute``, the tower ring)."""
    import collections
    import dataclasses

    from tfpar.objective import step

    combined = collections.Counter()  # shapes of what combine returned, as traced
    real = step.combine_gradients

    def recording_combine_gradients(loss):
        combine = real(loss)

        def recording(parts):
            out = combine(parts)
            combined[tuple(out.shape)] += 1
            return out
        return recording

    monkeypatch.setattr(step, "combine_gradients", recording_combine_gradients)
    s = setup("sentence")
    one_step = dataclasses.replace(s, spec=dataclasses.replace(s.spec, steps=1))
    run_plugin(one_step, dist)
    variables = collections.Counter(tuple(w.shape) for w in s.initial_weights)
    assert combined >= variables, (combined, variables)
