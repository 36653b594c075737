"""``tfpar-plot``: learning curves, from the ``metrics.jsonl`` of one or more model dirs.

    tfpar-plot runs/ptb-small --out curve.png
    tfpar-plot runs/a runs/b --out compare.png --metric valid_ppl

Every finished epoch appends one JSON line to ``<model-dir>/metrics.jsonl`` (epoch, step,
train_ppl, valid_ppl, learning_rate, tokens_per_sec, seconds; see
``tfpar.training.loop.append_epoch_metrics``). This command draws train and valid
perplexity by epoch (log scale), one colour per run, valid solid and train dashed, and the
learning rate below. A resumed run appends to the same file; an epoch written twice (a
run resumed from a checkpoint before an epoch end it had logged) is drawn once, the
later line winning. Needs matplotlib (the ``bench`` extra); model dirs on a URL
(``gs://…``) are read through TensorFlow's file systems.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from tfpar.errors import ConfigError
from tfpar.tools import cli
from tfpar.tools.parsing import Parser

METRICS = "metrics.jsonl"  # tfpar.training.loop.EPOCH_METRICS (this module imports no TF)
CURVES = ("train_ppl", "valid_ppl")
DESCRIPTION = "Learning curves (perplexity and learning rate by epoch) of training runs."


def parser(prog: str = "tfpar-plot") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=DESCRIPTION, allow_abbrev=False)
    p.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR",
                   help="a training run's model dir (holds metrics.jsonl); several are drawn "
                        "on one chart, labelled by their folder names")
    p.add_argument("--out", default="learning_curve.png",
                   help="the PNG to write (default: %(default)s)")
    p.add_argument("--metric", choices=("both",) + CURVES, default="both",
                   help="which perplexity to draw (default: %(default)s)")
    p.add_argument("--title", default="", help="the chart's title (default: the run names)")
    return p


def _read(path: str) -> str | None:
    """The file's text, or None when there is no such file."""
    if "://" in path:
        import tensorflow as tf

        if not tf.io.gfile.exists(path):
            return None
        with tf.io.gfile.GFile(path) as f:
            return f.read()
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_epochs(model_dir: str) -> list[dict]:
    """The run's epoch lines, sorted by epoch, one per epoch (the last written wins).

    Raises:
      ConfigError: the dir has no metrics.jsonl, a line is not JSON, or no line has an
        epoch.
    """
    path = model_dir.rstrip("/") + "/" + METRICS
    text = _read(path)
    if text is None:
        raise ConfigError(f"no {METRICS} in {model_dir!r}: give a model dir of a run that "
                          f"finished at least one epoch")
    epochs: dict[int, dict] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{path} line {number} is not JSON: {line[:60]!r}") from None
        if isinstance(record, dict) and "epoch" in record:
            epochs[int(record["epoch"])] = record
    if not epochs:
        raise ConfigError(f"{path} holds no epoch line: give a model dir of a run that "
                          f"finished at least one epoch")
    return [epochs[e] for e in sorted(epochs)]


def pyplot(missing: str):
    """matplotlib's pyplot on its file-only (Agg) backend: the charts of tfpar-plot and
    tfpar-benchmark --plot.

    Raises:
      ConfigError: ``missing``, when matplotlib (the ``bench`` extra) is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(missing) from None
    return plt


def draw(runs: dict[str, list[dict]], out: str, metric: str = "both", title: str = "") -> None:
    """Writes the chart of ``runs`` (label -> epoch lines) to ``out`` (PNG).

    Raises:
      ConfigError: matplotlib is not installed.
    """
    plt = pyplot("tfpar-plot needs matplotlib, which is not installed; install it with pip "
                 "install 'tfpar[bench]' (a clone: pip install -e '.[bench]')")
    curves = CURVES if metric == "both" else (metric,)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, epochs) in enumerate(runs.items()):
        colour = colours[i % len(colours)]
        x = [e["epoch"] for e in epochs]
        for curve in curves:
            points = [(e["epoch"], e[curve]) for e in epochs if e.get(curve) is not None]
            if points:
                top.plot(*zip(*points), color=colour, marker="o", ms=3,
                         ls="-" if curve == "valid_ppl" else "--",
                         label=f"{label} {curve.split('_')[0]}")
        lr = [e.get("learning_rate") for e in epochs]
        if all(v is not None for v in lr):
            bottom.plot(x, lr, color=colour, marker="o", ms=3)
    top.set_yscale("log")
    top.set_ylabel("perplexity")
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=8)
    top.set_title(title or ", ".join(runs), fontsize=9)
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("epoch")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    # Written beside and renamed: an interrupted plot leaves no half-written PNG.
    partial = out + ".partial"
    fig.savefig(partial, format="png", dpi=110)
    plt.close(fig)
    os.replace(partial, out)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-plot``: 0, or 2 on a usage error."""
    args = parser(prog or "tfpar-plot").parse_args(argv)
    cli.setup_logging(False)

    def body():
        if not args.out.lower().endswith(".png"):
            raise ConfigError(f"--out must name a .png file, got {args.out!r}")
        labels: dict[str, list[dict]] = {}
        for model_dir in args.model_dirs:
            label = os.path.basename(model_dir.rstrip("/")) or model_dir
            while label in labels:
                label += "'"
            labels[label] = read_epochs(model_dir)
        draw(labels, args.out, args.metric, args.title)
        print(f"wrote {args.out}: " + "; ".join(
            f"{label} {len(epochs)} epochs, best valid ppl "
            + (f"{min(e['valid_ppl'] for e in epochs if e.get('valid_ppl') is not None):.2f}"
               if any(e.get("valid_ppl") is not None for e in epochs) else "n/a")
            for label, epochs in labels.items()))

    return cli.run_main(body)


if __name__ == "__main__":
    from tfpar.tools.commands import start

    sys.exit(start("tfpar.tools.plot"))
