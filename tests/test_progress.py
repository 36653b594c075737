"""Progress off a terminal: plain log lines every --progress-every seconds (and at the
epoch end) instead of a Keras bar's carriage-return redraws; on a terminal, the bar."""

import logging
import re
import sys


from tfpar.training.hooks import ProgressHook, Record
from tfpar.tools.cli import train_main

LINE = re.compile(r"epoch (\d+): step (\d+)(?:/(\d+) \((\d+)%\))?, loss ([\d.]+), "
                  r"ppl ([\d.]+), ([\d,]+) tok/s(?:, ETA ([\dhms.]+))?$")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def record(step, nll=20.0, count=10.0):
    return Record(step=step, steps=1, nll=nll, count=count, grad_norm=1.0, seconds=0.5,
                  learning_rate=1.0)


def progress_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "tfpar.training.hooks"]


def test_off_a_terminal_a_line_every_n_seconds_and_one_at_the_epoch_end(caplog):
    clock = FakeClock()
    hook = ProgressHook(30.0, clock=clock, tty=False)
    caplog.set_level(logging.INFO, logger="tfpar.training.hooks")
    hook.start_epoch(10, epoch=0)
    assert hook.bar is None
    for step, at in enumerate([5.0, 20.0, 30.0, 45.0, 59.0, 61.0, 70.0], start=1):
        clock.now = 100.0 + at
        hook(record(step, nll=[30.0, 20.0, 10.0, 10.0, 10.0, 10.0, 10.0][step - 1]))
    # Lines at 30 s (step 3) and at 61 s (step 6: 31 s after the last); not at 59 s.
    assert [LINE.match(x).group(2) for x in progress_lines(caplog)] == ["3", "6"]
    first = progress_lines(caplog)[0]
    # After 3 of 10 steps in 30 s: 7 more take 70 s; the epoch's 60 nats over 30 tokens.
    assert first == "epoch 1: step 3/10 (30%), loss 2.00, ppl 7.39, 20 tok/s, ETA 1m10s"
    hook.end_epoch()
    lines = progress_lines(caplog)
    assert len(lines) == 3 and LINE.match(lines[-1]).group(2) == "7"
    hook.end_epoch()  # nothing new since: no second line of the same step
    assert len(progress_lines(caplog)) == 3


def test_progress_every_0_logs_only_at_the_epoch_end(caplog):
    clock = FakeClock()
    hook = ProgressHook(0.0, clock=clock, tty=False)
    caplog.set_level(logging.INFO, logger="tfpar.training.hooks")
    hook.start_epoch(None, epoch=1)
    for step in range(1, 5):
        clock.now += 1000.0
        hook(record(step))
    assert progress_lines(caplog) == []
    hook.end_epoch()
    assert progress_lines(caplog) == ["epoch 2: step 4, loss 2.00, ppl 7.39, 20 tok/s"]


def test_on_a_terminal_the_bar_and_no_lines(monkeypatch, caplog):
    import keras

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    clock = FakeClock()
    hook = ProgressHook(1.0, clock=clock)
    caplog.set_level(logging.INFO, logger="tfpar.training.hooks")
    hook.start_epoch(3, epoch=0)
    assert isinstance(hook.bar, keras.utils.Progbar)
    for step in range(1, 4):
        clock.now += 10.0
        hook(record(step))
    hook.end_epoch()
    assert progress_lines(caplog) == []
    assert hook.bar._seen_so_far == 3


def test_a_run_off_a_terminal_logs_lines_whose_last_ppl_is_the_epoch_lines(tiny_args,
                                                                           capsys):
    args = [a for a in tiny_args if a != "--no-progress"]
    args[args.index("--max-steps") + 1] = "0"  # the whole epoch
    args[args.index("--batch-size") + 1] = "100"  # 3 steps
    args += ["--lr", "0.1"]  # steps whose losses differ: the line must be the epoch's
    assert train_main(args + ["--no-export", "--progress-every", "0"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err
    assert captured.out == ""  # no bar
    lines = [LINE.search(x) for x in captured.err.splitlines()
             if x.startswith("I tfpar.training.hooks: ")]
    epochs = re.findall(r"epoch (\d)/1: train ppl ([\d.]+),", captured.err)
    assert [m.group(1) for m in lines] == ["1"] == [e[0] for e in epochs]
    for m, (_, train_ppl) in zip(lines, epochs):
        assert m.group(2) == m.group(3) and m.group(4) == "100"  # the epoch's end
        assert m.group(6) == train_ppl


def test_progress_every_below_0_is_refused_before_anything_is_written(tiny_args, tmp_path,
                                                                      capsys):
    assert train_main(tiny_args + ["--progress-every", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: progress-every must be >= 0, got -1.0\n"
    assert not (tmp_path / "run").exists()
