"""Where a run keeps its state, and that the messages say how to get back to it."""

import types

import pytest

from tfpar.training.loop import Interrupted, Loop


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
    loop = types.SimpleNamespace(
        stop_signal=types.SimpleNamespace(received="SIGTERM"), step=7,
        checkpointer=types.SimpleNamespace(directory="runs/x/checkpoints", save=saved.append),
        config=types.SimpleNamespace(run=types.SimpleNamespace(model_dir=given)))
    with pytest.raises(Interrupted) as stop:
        Loop.check_stop_signal(loop)
    assert saved == [7]
    assert str(stop.value) == ("stopped by SIGTERM after step 7; checkpoint saved in "
                               f"runs/x/checkpoints; run the same command {again} to resume")
