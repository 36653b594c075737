"""Where a run keeps its state, and that the messages say how to get back to it."""

import types

import pytest

from tfpar.errors import Interrupted
from tfpar.training.stopping import StopHook, run_again


def without_model_dir(args):
    i = args.index("--model-dir")
    return args[:i] + args[i + 2:]


def test_a_run_without_model_dir_logs_the_one_it_made_and_how_to_resume(tiny_args, tmp_path,
                                                                        monkeypatch, capsys):
    from tfpar.tools.cli import train_main

    monkeypatch.chdir(tmp_path)
    assert train_main(without_model_dir(tiny_args) + ["--no-export"]) == 0
    err = capsys.readouterr().err
    made = sorted((tmp_path / "runs").iterdir())
    assert len(made) == 1 and made[0].name.startswith("default-")
    line = next(x for x in err.splitlines() if "tfpar.training.checkpoints: model dir" in x)
    assert line.endswith(f"model dir runs/{made[0].name} (none was given: run again with "
                         f"--model-dir runs/{made[0].name} to resume this run)")


@pytest.mark.parametrize("given,again", [("", "with --model-dir runs/x"),
                                         ("runs/x", "again")])
def test_the_stop_message_names_the_model_dir_when_none_was_given(given, again):
    saved = []
    checkpointer = types.SimpleNamespace(directory="runs/x/checkpoints", save=saved.append)
    stop = StopHook(checkpointer, lambda: 7, run_again(given, checkpointer.directory))
    stop()  # no signal yet: nothing happens
    assert saved == []
    stop.signal.received = "SIGTERM"
    with pytest.raises(Interrupted) as stopped:
        stop()
    assert saved == [7]
    assert str(stopped.value) == ("stopped by SIGTERM after step 7; checkpoint saved in "
                                  f"runs/x/checkpoints; run the same command {again} to "
                                  "resume")


def test_the_progress_bar_shows_the_epochs_perplexity_so_far_per_token():
    """The bar's ppl after the last record is exp(total nll / total tokens), the epoch
    line's train ppl, not the mean of the steps' perplexities."""
    import math

    from tfpar.objective.losses import perplexity
    from tfpar.training.hooks import ProgressHook, Record

    hook = ProgressHook(tty=True)
    hook.start_epoch(3)
    records = [Record(step=1, steps=1, nll=80.0, count=10.0, grad_norm=1.0, seconds=1.0,
                      learning_rate=1.0),
               Record(step=2, steps=1, nll=60.0, count=30.0, grad_norm=1.0, seconds=1.0,
                      learning_rate=1.0),
               Record(step=3, steps=1, nll=20.0, count=20.0, grad_norm=1.0, seconds=2.0,
                      learning_rate=1.0)]
    for r in records:
        hook(r)
    def shown(key):  # what the bar prints: Keras keeps [value * steps, steps] (or [v, 1])
        total, steps = hook.bar._values[key]
        return total / max(steps, 1)

    assert shown("ppl") == pytest.approx(perplexity(160.0, 60.0))
    assert shown("ppl") == pytest.approx(math.exp(160.0 / 60.0))
    assert shown("loss") == pytest.approx(160.0 / 60.0)
    assert shown("tok/s") == pytest.approx(60.0 / 4.0)
    hook.start_epoch(3)  # a new epoch starts from nothing
    hook(records[2])
    assert shown("ppl") == pytest.approx(math.e)


def test_each_epoch_appends_a_line_to_metrics_jsonl_and_a_resumed_run_goes_on(tiny_args,
                                                                             tmp_path, capsys):
    import json

    import re

    from tfpar.tools.cli import train_main

    args = list(tiny_args)
    args[args.index("--max-steps") + 1] = "1000"
    args += ["--no-export", "--optimizer", "sgd", "--lr", "0.8", "--lr-decay", "0.5",
             "--decay-after", "1"]
    assert train_main(args[:args.index("--epochs") + 1] + ["2"] + args[args.index("--epochs") + 2:]) == 0
    err = capsys.readouterr().err
    path = tmp_path / "run" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [1, 2]
    assert lines[0]["learning_rate"] == pytest.approx(0.8)
    assert lines[1]["learning_rate"] == pytest.approx(0.4)
    assert lines[1]["step"] == 2 * lines[0]["step"] > 0
    last_epoch = [x for x in err.splitlines() if "epoch 2/2: train ppl" in x][0]
    assert f"valid ppl {lines[1]['valid_ppl']:.2f}," in last_epoch
    assert f"train ppl {lines[1]['train_ppl']:.2f}," in last_epoch
    assert train_main(args[:args.index("--epochs") + 1] + ["3"] + args[args.index("--epochs") + 2:]) == 0
    assert re.search(rf"resumed from \S*ckpt-{lines[1]['step']} \(step {lines[1]['step']}\)",
                     capsys.readouterr().err)
    more = [json.loads(x) for x in path.read_text().splitlines()]
    assert more[:2] == lines and [x["epoch"] for x in more] == [1, 2, 3]
    assert more[2]["learning_rate"] == pytest.approx(0.2)
