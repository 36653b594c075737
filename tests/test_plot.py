"""tfpar-plot: learning curves drawn from model dirs' metrics.jsonl, and its one-line errors."""

import json
import os
import struct
import sys

import pytest

from conftest import load_script
from tfpar.tools.plot import read_epochs
from tfpar.training.loop import append_epoch_metrics

plot = load_script("plot")


def write_run(model_dir, lines):
    os.makedirs(model_dir, exist_ok=True)
    for line in lines:
        append_epoch_metrics(str(model_dir), line)


def epoch(n, valid, lr=1.0):
    return {"epoch": n, "step": 10 * n, "train_ppl": valid * 1.5, "valid_ppl": valid,
            "learning_rate": lr, "tokens_per_sec": 1000.0, "seconds": 1.0}


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_two_runs_on_one_chart_with_a_resumed_epoch_drawn_once(tmp_path, capsys):
    # Run a was resumed from before its epoch-2 end: epoch 2 is in the file twice, and the
    # later line (valid 150) is the one that counts.
    write_run(tmp_path / "a", [epoch(1, 200.0), epoch(2, 170.0), epoch(2, 150.0, 0.5),
                               epoch(3, 140.0, 0.25)])
    write_run(tmp_path / "b", [epoch(1, 210.0), epoch(2, 190.0)])
    out = tmp_path / "charts" / "curve.png"
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == (f"wrote {out}: a 3 epochs, best valid ppl 140.00; "
                               f"b 2 epochs, best valid ppl 190.00")
    assert png_size(out) == (880, 660)  # 8 x 6 inches at 110 dpi
    assert not os.path.exists(str(out) + ".partial")
    epochs = read_epochs(str(tmp_path / "a"))
    assert [(e["epoch"], e["valid_ppl"]) for e in epochs] == [(1, 200.0), (2, 150.0), (3, 140.0)]


@pytest.mark.parametrize("case, expected", [
    ("missing", "error: no metrics.jsonl in '{d}': give a model dir of a run that finished "
                "at least one epoch"),
    ("not json", "error: {d}/metrics.jsonl line 2 is not JSON: '{{oops'"),
    ("no epoch", "error: {d}/metrics.jsonl holds no epoch line: give a model dir of a run "
                 "that finished at least one epoch"),
    ("not png", "error: --out must name a .png file, got 'curve.jpg'"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, case, expected):
    d = tmp_path / "run"
    os.makedirs(d)
    if case == "not json":
        (d / "metrics.jsonl").write_text(json.dumps(epoch(1, 100.0)) + "\n{oops\n")
    elif case == "no epoch":
        (d / "metrics.jsonl").write_text('{"step": 3}\n')
    elif case == "not png":
        write_run(d, [epoch(1, 100.0)])
    out = "curve.jpg" if case == "not png" else str(tmp_path / "curve.png")
    assert plot.main([str(d), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err == expected.format(d=d) + "\n"
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    write_run(tmp_path / "run", [epoch(1, 100.0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == (
        "error: tfpar-plot needs matplotlib, which is not installed; install it with "
        "pip install 'tfpar[bench]' (a clone: pip install -e '.[bench]')\n")


def test_a_selection_of_the_suite_is_not_failed_by_the_coverage_floor(tmp_path):
    """``PYTEST_ARGS="-k …" make coverage`` reports coverage but passes:
    the floor in pyproject is the whole suite's (tests/conftest.py lifts it for a
    selection). Run on this cheap file: a few percent of the package is covered."""
    import subprocess

    from conftest import REPO

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cov",
         "--cov-report=term", "-k", "resumed_epoch_drawn_once", "tests/test_plot.py"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        # Its own coverage data, apart from a surrounding --cov run's.
        env={**{k: v for k, v in os.environ.items() if not k.startswith("COV_CORE")},
             "COVERAGE_FILE": str(tmp_path / ".coverage")})
    assert done.returncode == 0, done.stdout[-2000:]
    assert "1 passed" in done.stdout and "TOTAL" in done.stdout
    assert "Required test coverage" not in done.stdout
