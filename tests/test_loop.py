"""The one training path (``Loop.train_epoch`` over ``runner.make_train_steps``) against a
hand-written per-step loop over ``step.make_train_step``: the same weights bit for bit,
the same number of updates, the stream state carried from window to window (an epoch's
first window from zeros), and a window whose update was not applied neither counted nor
carried on.

The reference is written here on purpose: every other test of the loop compares it with
itself (one step per call against ten, a resumed run against an uninterrupted one), which
a loop that forgot the carried state, or counted a skipped step, would pass.
"""

import keras
import numpy as np
import pytest

from conftest import hand_built_loop, model_config, small_config, train_config
from tfpar.config import DataConfig, DistConfig, RunConfig
from tfpar.data.pipeline import InputData
from tfpar.data.vocab import Vocab
from tfpar.objective.step import make_eval_step, make_train_step
from tfpar.parallel.registry import build_strategy
from tfpar.parallel.rows import replica_batches
from tfpar.training.loop import evaluate
from tfpar.training.state import build_train_state

MODEL = model_config(embed_dim=8, hidden_dim=8)
ROWS = 4


def adam(epoch, lr_scale):
    return keras.optimizers.Adam(0.01)


def lines(poisoned: bool) -> list[str]:
    rng = np.random.default_rng(0)
    out = [" ".join(f"w{int(i)}" for i in rng.integers(0, 12, size=6)) for _ in range(40)]
    if poisoned:
        out[20] = "w1 w2 zz w3 w4"  # the word whose embedding row becomes NaN
    else:
        out[20] = "w1 w2 w3 w4 zz"  # (the same vocabulary)
    return out


def build(tmp_path, mode: str, poisoned: bool, spe: int = 1):
    """A fresh train state on one device (the same initial weights every call), its data,
    and a Loop of ``spe`` steps per call."""
    text = lines(poisoned)
    vocab = Vocab.build(text)
    config = small_config(data=DataConfig(mode=mode, bptt=4),
                          model=MODEL,
                          train=train_config(batch_size=ROWS, on_nan="skip", epochs=1,
                                             clip_norm=5.0, steps_per_execution=spe),
                          run=RunConfig(model_dir=str(tmp_path), progress=False))
    data = InputData({"train": text, "valid": text[:4], "test": text[:4]}, vocab,
                     config.data, seed=0)
    plugin = build_strategy(DistConfig())
    state = build_train_state(plugin.scope(), MODEL, len(vocab), seed=0, make_optimizer=adam,
                              fixed_shapes=mode == "stream",
                              carry_rows=ROWS if mode == "stream" else 0)
    loop = hand_built_loop(config, plugin, data, state, tmp_path, clip_norm=5.0,
                           poison="zz" if poisoned else None)
    return loop, plugin, state, data


def reference_epoch(plugin, state, data, stream: bool):
    """One epoch the plain way: a step per batch, each window from the state the one
    before ended in (the first from none), a fresh state after a window whose update was
    not applied. Returns (updates, windows not applied)."""
    step = make_train_step(plugin, state.model, state.optimizer, clip_norm=5.0)
    carried, applied, skipped = None, 0, 0
    batches = plugin.distribute(lambda ctx: replica_batches(
        data, "train", training=True, epoch=0, skip=0, input_context=ctx, batch_size=ROWS))
    for batch in batches:
        out = step(batch, carried)
        ok = np.isfinite(float(out.nll_sum)) and np.isfinite(float(out.grad_norm))
        applied, skipped = applied + ok, skipped + (not ok)
        carried = out.state if stream and ok else None
    return applied, skipped


def weights(state) -> list[np.ndarray]:
    return [v.numpy() for v in state.model.trainable_variables]


@pytest.mark.parametrize("mode,poisoned,spe", [
    ("stream", False, 1), ("stream", True, 1), ("stream", True, 3), ("sentence", True, 3)])
def test_an_epoch_of_the_loop_is_the_hand_written_per_step_epoch(mode, poisoned, spe,
                                                                  tmp_path):
    _, plugin, state, data = build(tmp_path / "ref", mode, poisoned)
    updates, skipped = reference_epoch(plugin, state, data, mode == "stream")
    assert updates > 5 and skipped == (1 if poisoned else 0)
    want = weights(state)

    loop, _, state, _ = build(tmp_path / "loop", mode, poisoned, spe)
    recorded = []
    loop.hooks.append(lambda record: recorded.append(record.step))
    loop.train_epoch(0, 0)
    assert recorded == list(range(1, updates + 1))  # each applied step, by its number
    # One graph for every call: the first window's (from zeros), the rest, the shorter
    # last window and the one after a restart.
    assert loop.train.function.experimental_get_tracing_count() == 1
    assert state.step == updates  # the optimizer's count: updates applied
    assert loop.progress.skipped == skipped  # the loop's count of the others
    assert int(state.batch_in_epoch.numpy()) == updates + skipped
    got = weights(state)
    # (the poisoned embedding row stays NaN in both)
    assert [i for i, (g, w) in enumerate(zip(got, want))
            if not np.array_equal(g, w, equal_nan=True)] == []


def test_stream_mode_without_carry_variables_is_refused():
    """Without them the zeros would have no shape, and every window would start afresh."""
    import types

    from tfpar.training.carry import StreamCarry

    with pytest.raises(ValueError, match=r"stream mode carries the state in the train "
                                         r"state's carry variables: build_train_state"):
        StreamCarry(None, types.SimpleNamespace(carried=lambda: None), stream=True)
    assert StreamCarry(None, types.SimpleNamespace(carried=lambda: None),
                       stream=False).current is None


def test_a_stream_evaluation_scores_the_windows_from_zeros_in_two_graphs(tmp_path):
    """Evaluation's first window starts from explicit zeros: the score of the windows
    carried the plain way (the first from no state at all), with one graph for the full
    windows, the first included, and one for the shorter last (three before, the first
    window traced apart)."""
    _, plugin, state, data = build(tmp_path, "stream", False)
    text = lines(False)[:9]  # columns of 15 tokens: windows of 4, 4, 4 and 2
    data = InputData({"train": text, "valid": text, "test": text}, data.vocab, data.config,
                     seed=0)
    step = make_eval_step(plugin, state.model)
    nll, count = evaluate(plugin, step, data, "valid", ROWS)
    assert step.function.experimental_get_tracing_count() == 2

    plain = make_eval_step(plugin, state.model)
    carried, want = None, []
    for batch in plugin.distribute(lambda ctx: replica_batches(
            data, "valid", training=False, input_context=ctx, batch_size=ROWS)):
        out = plain(batch, carried)
        carried = out.state
        want.append((float(out.nll_sum), float(out.count)))
    assert len(want) == 4
    assert (nll, count) == (sum(w[0] for w in want), sum(w[1] for w in want))
