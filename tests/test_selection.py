"""Model selection by valid perplexity: the best checkpoint, --early-stop,
--lr-decay-on-plateau, --final-weights.

The epoch-end valid perplexities are scripted (the loop's ``evaluate`` patched: 10, 9, 9.5,
9.7, 9.9, ...), so which epoch is best, when the rate drops and when training stops are
known in advance; everything else (training, checkpoints, the final evaluation, the
export) is real.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from conftest import PINNED
from faults import checkpoint_tensors
from tfpar.tools import plot
from tfpar.tools.cli import train_main
from tfpar.training import loop, run  # noqa: F401 (run binds the real evaluate first)

SCRIPTED = [10.0, 9.0, 9.5, 9.7, 9.9, 9.8]  # below the real ~40: best stays best
SGD = ["--optimizer", "sgd", "--lr", "0.5"]


def scripted_valid(monkeypatch):
    """The loop's epoch-end evaluations return SCRIPTED's perplexities in turn."""
    calls = iter(SCRIPTED)

    def evaluate(plugin, eval_step, data, split, batch_size):
        assert split == "valid"
        return float(np.log(next(calls))) * 1000.0, 1000.0
    monkeypatch.setattr(loop, "evaluate", evaluate)


def run_args(tiny_corpus_dir, tmp_path, *extra):
    return ["--data", str(tiny_corpus_dir), *PINNED, *SGD, "--embed-dim", "8",
            "--hidden-dim", "8", "--batch-size", "100", "--no-progress",
            "--model-dir", str(tmp_path / "run"), "--export-dir", str(tmp_path / "export"),
            "--metrics-json", str(tmp_path / "m.json"), *extra]


def best_tensors(tmp_path) -> dict:
    """The tensors of <model-dir>/best's checkpoint (``checkpoint_tensors`` reads the
    checkpoints folder)."""
    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "best"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


def lines(tmp_path):
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_plateau_decay_early_stop_and_the_best_weights(tiny_corpus_dir, tmp_path, monkeypatch,
                                                       capsys):
    """300 sentences in batches of 100: 3 steps an epoch. Epoch 2 is the best (9); epochs
    3 and 4 do not improve, so the rate drops to 0.25 then 0.0625 of --lr, and
    --early-stop 2 stops training after epoch 4 (of 6). The final evaluation and the
    export use epoch 2's weights (step 6), restored from <model-dir>/best."""
    scripted_valid(monkeypatch)
    assert train_main(run_args(tiny_corpus_dir, tmp_path, "--epochs", "6", "--early-stop", "2",
                               "--lr-decay-on-plateau", "0.25")) == 0
    err = capsys.readouterr().err
    epochs = lines(tmp_path)
    assert [(x["epoch"], x["step"], x["valid_ppl"]) for x in epochs] == \
        [(1, 3, pytest.approx(10)), (2, 6, pytest.approx(9)), (3, 9, pytest.approx(9.5)),
         (4, 12, pytest.approx(9.7))]
    # The rate each epoch's last step used: the drop comes after epoch 3's line.
    assert [x["learning_rate"] for x in epochs] == pytest.approx([0.5, 0.5, 0.5, 0.125])
    assert "valid ppl 9.50 is no better than 9.00 (epoch 2): learning rate x 0.25" in err
    assert "--early-stop 2: 2 epochs without a better valid perplexity than 9.00 (epoch 2)" \
        in err

    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] == 12 and m["stopped_early"] is True
    assert m["final_weights"] == {"kind": "best", "epoch": 2, "step": 6,
                                  "valid_ppl": pytest.approx(9.0)}
    assert m["valid_ppl"] == pytest.approx(9.0)
    assert "valid and test of the best weights (epoch 2, step 6); training stopped early" in err

    best = best_tensors(tmp_path)
    latest = checkpoint_tensors(tmp_path / "run")
    assert int(best["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 6
    assert int(latest["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 12
    assert float(latest["selection/lr_scale/.ATTRIBUTES/VARIABLE_VALUE"]) == 0.0625
    assert int(latest["selection/stale_epochs/.ATTRIBUTES/VARIABLE_VALUE"]) == 2
    # The export holds epoch 2's weights, not the last ones.
    reader = tf.train.load_checkpoint(str(tmp_path / "export" / "tfpar_lm" / "1" / "variables"
                                          / "variables"))
    exported = [reader.get_tensor(k) for k in reader.get_variable_to_shape_map()]
    key = [k for k in best if k.startswith("layers/softmax:kernel")][0]
    assert not np.array_equal(best[key], latest[key])
    assert any(np.array_equal(t, best[key]) for t in exported)
    assert not any(np.array_equal(t, latest[key]) for t in exported)


def test_last_weights_and_a_resume_keeps_the_selection(tiny_corpus_dir, tmp_path, monkeypatch,
                                                       capsys):
    """--final-weights last evaluates the last weights; a resumed run continues the
    patience and the decayed rate from the checkpoint (epochs 1-3, then 4-5)."""
    scripted_valid(monkeypatch)
    args = run_args(tiny_corpus_dir, tmp_path, "--lr-decay-on-plateau", "0.5",
                    "--final-weights", "last", "--no-export")
    assert train_main(args + ["--epochs", "3"]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["final_weights"] == {"kind": "last", "epoch": 3, "step": 9,
                                  "valid_ppl": pytest.approx(m["valid_ppl"])}
    assert m["stopped_early"] is False
    assert train_main(args + ["--epochs", "5"]) == 0  # scripted: 9.7, 9.9 (no better)
    epochs = lines(tmp_path)
    assert [x["epoch"] for x in epochs] == [1, 2, 3, 4, 5]
    assert [x["learning_rate"] for x in epochs] == pytest.approx([0.5, 0.5, 0.5, 0.25, 0.125])
    latest = checkpoint_tensors(tmp_path / "run")
    assert float(latest["selection/best_valid_ppl/.ATTRIBUTES/VARIABLE_VALUE"]) == \
        pytest.approx(9.0)
    assert int(latest["selection/stale_epochs/.ATTRIBUTES/VARIABLE_VALUE"]) == 3
    # The resumed run's learning curve draws (tfpar-plot reads the same metrics.jsonl).
    assert plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "curve.png"),
                      "--metric", "valid_ppl", "--title", "resumed"]) == 0
    assert capsys.readouterr().out.startswith(
        f"wrote {tmp_path / 'curve.png'}: run 5 epochs, best valid ppl 9.00")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_mid_epoch_last_weights_that_beat_the_best_are_used(tiny_corpus_dir, tmp_path,
                                                             monkeypatch):
    """Epoch 1 scripted at 100 000 (worse than anything): the last weights, 2 steps into
    epoch 2, are better, so they are used; the kept best stays epoch 1's."""
    monkeypatch.setattr(loop, "evaluate", lambda *a: (float(np.log(1e5)) * 1000.0, 1000.0))
    assert train_main(run_args(tiny_corpus_dir, tmp_path, "--epochs", "2", "--max-steps", "5",
                               "--no-export")) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["final_weights"]["kind"] == "last" and m["final_weights"]["step"] == 5
    assert m["final_weights"]["epoch"] == 0  # not an epoch end
    assert m["final_weights"]["valid_ppl"] == pytest.approx(m["valid_ppl"])
    assert m["valid_ppl"] < 1e5
    best = best_tensors(tmp_path)
    assert int(best["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 3


@pytest.mark.parametrize("max_steps,want", [
    (0, ["valid", "valid", "test"]),  # 2 epochs: each end's valid, then test
    (4, ["valid", "valid", "test"]),  # 1 step into epoch 2: epoch 1's, the last weights'
])
def test_the_last_epoch_ends_valid_evaluation_is_the_finals(max_steps, want, tiny_corpus_dir,
                                                            tmp_path, monkeypatch):
    """Weights the last epoch end evaluated are not evaluated again at the end (the same
    weights, a deterministic evaluation): the final valid perplexity is that epoch's, to
    the bit. A run that ends mid-epoch evaluates its last weights."""
    calls, real = [], run.evaluate

    def counted(plugin, eval_step, data, split, batch_size):
        calls.append(split)
        return real(plugin, eval_step, data, split, batch_size)

    monkeypatch.setattr(loop, "evaluate", counted)
    monkeypatch.setattr(run, "evaluate", counted)
    assert train_main(run_args(tiny_corpus_dir, tmp_path, "--epochs", "2", "--max-steps",
                               str(max_steps), "--final-weights", "last", "--no-export")) == 0
    assert calls == want
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["final_weights"]["step"] == (max_steps or 6)
    if not max_steps:
        assert m["valid_ppl"] == lines(tmp_path)[-1]["valid_ppl"]


@pytest.mark.parametrize("flags,message", [
    (["--lr-decay-on-plateau", "1.5"], "error: --lr-decay-on-plateau must be in [0, 1) (0: off; "
                                       "0.25 divides the rate by 4), got 1.5"),
    (["--early-stop", "-1"], "error: early-stop must be >= 0, got -1"),
    (["--final-weights", "worst"], "error: unknown final-weights 'worst'; expected one of: "
                                   "best, last"),
])
def test_bad_selection_flags_are_one_line(flags, message, tiny_corpus_dir, tmp_path, capsys):
    assert train_main(run_args(tiny_corpus_dir, tmp_path, *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message), err
    assert not (tmp_path / "run").exists()


def test_no_best_checkpoint_to_restore_is_one_line(tmp_path):
    from tfpar.errors import CheckpointError
    from tfpar.training.checkpoints import Checkpointer

    ckpt = Checkpointer(str(tmp_path / "run"), True, 1, step=tf.Variable(0))
    with pytest.raises(CheckpointError) as e:
        ckpt.restore_best()
    assert str(e.value) == (f"no best checkpoint in {tmp_path / 'run' / 'best'}; run with "
                            "--final-weights last")
