"""Long, wide strategy-equivalence runs, shared by the tests that compare a strategy with
``default`` through verify's runners (test_strategies_equivalence, test_tower,
test_pipeline, test_multi_worker):

* :data:`STEPS` SGD-with-momentum steps, enough for float rounding to pile up and for
  the clip norm to fall between the norms of the steps actually taken;
* the clip norm verify chooses (:func:`auto_clip_norm`: the median gradient norm of the
  first STEPS batches at the initial weights, measured with
  ``tfpar.tools.verify.initial_gradient_norms``), and every comparison asserts that the
  runs it compares had clipped and unclipped steps: on a clipped step a gradient off by
  a constant factor gives the very same update, so only unclipped steps (and the norms)
  catch it, and only clipped ones catch a wrong clip;
* in stream mode, the recurrent state carried out of the last window, in global form
  (``plugin.global_state``: one [B, H] tensor per layer and state part, what a checkpoint
  holds), compared with default's like the weights (:func:`run_with_state`). A strategy
  that carried a wrong state trains differently from the next window on; the global form
  is also what a checkpoint stores and a resumed run starts from, which the mirrored
  family builds by gathering its replicas' states only then.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tfpar.model.lm import build_model
from tfpar.tools import verify
from tfpar.tools.verify import RunResult, Setup, VerifySpec

# Steps every equivalence run takes (was 3): the sentence-mode corpora of these tests
# have 16 batches of 10 rows an epoch, the stream ones ~30 windows, so one epoch holds them.
STEPS = 12
# How far the carried state may be from default's: the weights' tolerance.
STATE_TOLERANCE = 1e-5


def auto_clip_norm(model_config, data, weights, batch_size: int, steps: int = STEPS) -> float:
    """verify's automatic clip norm (``tfpar.tools.verify.build_setup`` with
    ``--clip-norm 0``): the median of ``initial_gradient_norms`` over the first ``steps``
    training batches at the initial ``weights``."""
    with tf.device("/cpu:0"):
        model = build_model(model_config, len(data.vocab), seed=0)
        model.set_weights(weights)
        return float(np.median(verify.initial_gradient_norms(model, data, batch_size, steps)))


def make_setup(data, model_config, mode: str, *, batch_size: int, lr: float = 0.5,
               steps: int = STEPS, seed: int = 0) -> Setup:
    """A verify ``Setup`` for ``data``: seeded initial weights, SGD with momentum,
    ``steps`` steps and the automatic clip norm."""
    weights = build_model(model_config, len(data.vocab), seed=seed).get_weights()
    spec = VerifySpec(steps=steps, batch_size=batch_size, mode=mode, lr=lr)
    clip = auto_clip_norm(model_config, data, weights, batch_size, steps)
    return Setup(spec, data, model_config, weights, clip, clip_norm_auto=True)


@dataclasses.dataclass
class Recorder:
    """What :func:`recording` saw: the plug-ins verify built, every step's output and
    the state the last training call carried out."""

    plugins: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    last_state: object = None

    def final_state(self) -> list[np.ndarray]:
        """The state the last step carried out, in global form."""
        state = self.plugins[-1].global_state(self.last_state)
        return [np.asarray(s) for s in tf.nest.flatten(state)]


@contextlib.contextmanager
def recording():
    """Runs verify's runners as they are, recording the plug-in each one builds, the
    output of each step it takes and the state its training calls carry out
    (``run_plugin`` discards it)."""
    rec = Recorder()
    real_build, real_make = verify.build_strategy, verify.make_train_steps

    def build_strategy(dist, model=None):
        rec.plugins.append(real_build(dist, model))
        return rec.plugins[-1]

    def make_train_steps(*args, **kwargs):
        steps = real_make(*args, **kwargs)

        def recorded(iterator, state, n):
            call = steps(iterator, state, n)
            rec.outputs.extend(call.outputs)
            rec.last_state = call.state
            return call

        return recorded

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify, "build_strategy", build_strategy)
        patch.setattr(verify, "make_train_steps", make_train_steps)
        yield rec


def record_worker(code: str, state_path: str) -> None:
    """A worker process of ``verify.run_multi_worker`` that runs the ``code`` verify gives
    it (its ``multi_worker_task``) under :func:`recording`; then every worker joins the
    gather of the final carried state (a collective) and the chief saves it to
    ``state_path`` (``np.savez``, one array per layer and state part)."""
    with recording() as rec:
        exec(code, {})  # verify's own worker command
    state = rec.final_state()
    if rec.plugins[-1].is_chief:
        np.savez(state_path, *state)


@dataclasses.dataclass
class Run:
    """A verify RunResult and the state its last window carried out (stream mode)."""

    result: RunResult
    state: list[np.ndarray] | None


def run_with_state(runner, setup: Setup, arg) -> Run:
    """``runner(setup, arg)`` (``verify.run_plugin`` with a DistConfig, ``run_pipeline``
    with a replica count, ...) and the final carried state."""
    with recording() as rec:
        result = runner(setup, arg)
    assert len(rec.outputs) == setup.spec.steps
    return Run(result, rec.final_state() if setup.spec.mode == "stream" else None)


def assert_same_state(got: Run, ref: Run, setup: Setup) -> None:
    """Stream mode: the carried state after the last step, every layer and part, all
    rows, within :data:`STATE_TOLERANCE` of default's (and not zeros)."""
    # conftest is imported here, not at the top: the worker processes of record_worker
    # import this module, and conftest would give them 4 logical CPU devices.
    from conftest import max_diff

    assert (got.state is None) == (ref.state is None) == (setup.spec.mode != "stream")
    if ref.state is None:
        return
    rows = setup.spec.batch_size
    layers = setup.model_config.layers
    assert len(ref.state) == len(got.state) == 2 * layers  # h and c of each LSTM layer
    for s, r in zip(got.state, ref.state):
        assert s.shape == r.shape == (rows, setup.model_config.hidden_dim)
        assert np.abs(r).max(axis=1).min() > 0  # every row carries a state
    diff = max_diff(got.state, ref.state)
    assert diff <= STATE_TOLERANCE, f"the carried state is {diff:.3g} off default's"


def assert_equivalent(got: Run, ref: Run, setup: Setup) -> None:
    """``got`` trained what default (``ref``) trained: clipped and unclipped steps in
    both, the same norms, weights, momentum slots and carried state, and the same eval."""
    from conftest import assert_clipped_and_unclipped, assert_same_training, max_diff

    assert_clipped_and_unclipped(ref.result.grad_norms, setup.clip_norm)
    assert_clipped_and_unclipped(got.result.grad_norms, setup.clip_norm)
    assert max_diff(ref.result.weights, setup.initial_weights) > 1e-3  # Training moved them.
    assert_same_training(got.result, ref.result, setup.spec.steps)  # norms, weights, slots
    assert_same_state(got, ref, setup)
    assert got.result.eval_count == ref.result.eval_count
    assert got.result.eval_nll == pytest.approx(ref.result.eval_nll, rel=1e-6)
