#!/usr/bin/env python3
"""tfpar beside PyTorch's ``word_language_model``, like for like, one epoch per run:

    python scripts/quality_matrix.py --data ../shared/data --torch-python VENV/bin/python \\
        --torch-example EXAMPLES/word_language_model --out runs/matrix

Both tools get the same token streams, written here from ``--data`` (``ptb/``,
``wikitext-2/``): each split's lines stripped, blank lines dropped (tfpar drops them; the
peer would predict an ``<eos>`` for each), and for the character rows every character a
token, a space the token ``_``, one ``<eos>`` per line (both tools add it). The same
architecture and hyperparameters (PyTorch's defaults: 2x200, bptt 35, batch 20, SGD lr 20,
clip 0.25, dropout 0.2, the last step's weights) and the same tying on each row; one epoch;
seeds 0 and 1. Runs go
one after another, so their wall times compare (the host's speed still drifts).

Prints one line per run and, at the end, the table (markdown) with each row's mean
valid and test perplexity over the seeds, the seed spread, bits per character on
character rows, and the wall time. ``--rows`` picks rows; ``--tfpar-flags`` adds flags to
every tfpar run (e.g. ``--forget-bias 1`` to measure a setting); results accumulate in
``OUT/results.jsonl``, and a run already there is not repeated.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tfpar.tools.parsing import Parser  # noqa: E402  (no TensorFlow)

# Every run's hyperparameters, PyTorch's defaults (its flag names, then tfpar's).
COMMON_TORCH = ["--emsize", "200", "--nhid", "200", "--nlayers", "2", "--lr", "20",
                "--clip", "0.25", "--bptt", "35", "--batch_size", "20", "--dropout", "0.2",
                "--epochs", "1"]
COMMON_TFPAR = ["--embed-dim", "200", "--hidden-dim", "200", "--layers", "2", "--lr", "20",
                "--clip-norm", "0.25", "--bptt", "35", "--batch-size", "20", "--dropout", "0.2",
                "--epochs", "1", "--optimizer", "sgd", "--no-export", "--no-progress",
                "--no-epoch-inspection", "--ema-momentum", "0"]
# (--ema-momentum 0: the last step's weights, as the peer reports; tfpar's default moving
# average is measured apart: --tag ema --tfpar-flags '--ema-momentum 0.99'.)
# name -> (corpus, cell, tied, tfpar mode; None: no PyTorch run).
ROWS = {
    "ptb-words": ("ptb-words", "lstm", False, "stream"),
    "ptb-words-tied": ("ptb-words", "lstm", True, "stream"),
    "wt2-words": ("wt2-words", "lstm", False, "stream"),
    "wt2-words-tied": ("wt2-words", "lstm", True, "stream"),
    "ptb-chars": ("ptb-chars", "lstm", False, "stream"),
    "wt2-chars": ("wt2-chars", "lstm", False, "stream"),
    "ptb-words-gru": ("ptb-words", "gru", False, "stream"),
    "ptb-words-sentence": ("ptb-words", "lstm", False, "sentence"),
}
SOURCES = {"ptb": ("ptb", "ptb.{}.txt"), "wt2": ("wikitext-2", "wiki.{}.tokens")}
# The example's last lines; its perplexities have two decimals (its losses only two too).
TORCH_VALID = re.compile(r"end of epoch\s+1 \|.*valid ppl\s+([\d.]+)")
TORCH_TEST = re.compile(r"End of training \|.*test ppl\s+([\d.]+)")


def char_tokens(line: str) -> str:
    """One line of text as space-separated characters, a space written ``_``:
    ``"a b"`` -> ``"a _ b"``."""
    return " ".join("_" if c == " " else c for c in line)


def write_corpus(data: Path, name: str, out: Path) -> Path:
    """``OUT/corpora/NAME/{train,valid,test}.txt`` from ``--data`` (see the module doc)."""
    source, unit = name.split("-")
    folder, pattern = SOURCES[source]
    target = out / "corpora" / name
    target.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        dest = target / f"{split}.txt"
        if dest.exists():
            continue
        lines = (data / folder / pattern.format(split)).read_text(encoding="utf-8").splitlines()
        lines = [line.strip() for line in lines if line.strip()]
        if unit == "chars":
            lines = [char_tokens(line) for line in lines]
        tmp = dest.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(dest)
    return target


def run_tfpar(corpus: Path, row: tuple, seed: int, work: Path, extra: list[str]) -> dict:
    _, cell, tied, mode = row
    metrics = work / "metrics.json"
    # A run not in results.jsonl trains anew: a model dir left by an earlier run (another
    # code, a crash) would be resumed, and at its end only evaluated.
    shutil.rmtree(work / "run", ignore_errors=True)
    metrics.unlink(missing_ok=True)
    argv = [sys.executable, str(REPO / "scripts" / "train.py"), "--data", str(corpus),
            "--mode", mode, "--cell", cell, "--seed", str(seed), "--model-dir", str(work / "run"),
            "--metrics-json", str(metrics), *COMMON_TFPAR,
            "--tie-embeddings" if tied else "--no-tie-embeddings", *extra]
    start = time.time()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL,
                   stderr=open(work / "stderr.log", "w"))
    m = json.loads(metrics.read_text())
    return {"valid_ppl": m["valid_ppl"], "test_ppl": m["test_ppl"],
            "seconds": time.time() - start}


def run_torch(python: str, example: Path, corpus: Path, row: tuple, seed: int,
              work: Path) -> dict:
    _, cell, tied, _ = row
    argv = [python, str(example / "main.py"), "--data", str(corpus), "--model", cell.upper(),
            "--seed", str(seed), "--save", str(work / "model.pt"), *COMMON_TORCH,
            *(["--tied"] if tied else [])]
    start = time.time()
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    (work / "stdout.log").write_text(out)
    valid, test = TORCH_VALID.search(out), TORCH_TEST.search(out)
    return {"valid_ppl": float(valid.group(1)), "test_ppl": float(test.group(1)),
            "seconds": time.time() - start}


def table(results: list[dict]) -> str:
    """The markdown table: one line per (row, tool), means over seeds."""
    lines = ["| row | tool | seeds | valid ppl (mean) | spread | test ppl (mean) | bpc valid "
             "| wall s (mean) |", "|---|---|---|---|---|---|---|---|"]
    keys = []
    for r in results:
        if (r["row"], r["tool"]) not in keys:
            keys.append((r["row"], r["tool"]))
    for row, tool in keys:
        rs = [r for r in results if r["row"] == row and r["tool"] == tool]
        valid = [r["valid_ppl"] for r in rs]
        mean_valid = sum(valid) / len(valid)
        mean_test = sum(r["test_ppl"] for r in rs) / len(rs)
        bpc = f"{math.log2(mean_valid):.3f}" if "chars" in row else ""
        lines.append(f"| {row} | {tool} | {','.join(str(r['seed']) for r in rs)} | "
                     f"{mean_valid:.2f} | {max(valid) - min(valid):.2f} | {mean_test:.2f} | "
                     f"{bpc} | {sum(r['seconds'] for r in rs) / len(rs):.0f} |")
    return "\n".join(lines)


def parse_args(argv):
    p = Parser(prog="quality_matrix.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=Path,
                   help="folder holding ptb/ and wikitext-2/ (the shared corpora)")
    p.add_argument("--torch-python", required=True,
                   help="a Python with PyTorch (its own venv; never tfpar's)")
    p.add_argument("--torch-example", required=True, type=Path,
                   help="pytorch/examples' word_language_model folder (holding main.py)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "quality-matrix",
                   help="corpora, logs and results.jsonl go here")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated rows (default: all of {', '.join(ROWS)})")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    p.add_argument("--tools", default="tfpar,pytorch", help="tfpar, pytorch or both")
    p.add_argument("--tag", default="", help="a name for this tfpar variant in the table "
                   "(with --tfpar-flags)")
    p.add_argument("--tfpar-flags", default="",
                   help="extra flags for every tfpar run, one string (e.g. '--forget-bias 1')")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    for row in rows:
        if row not in ROWS:
            p.error(f"unknown row {row!r}; rows: {', '.join(ROWS)}")
    for folder in ("ptb", "wikitext-2"):
        if not (args.data / folder).is_dir():
            p.error(f"--data {args.data} holds no {folder}/ folder")
    if "pytorch" in args.tools and not (args.torch_example / "main.py").is_file():
        p.error(f"--torch-example {args.torch_example} holds no main.py")
    args.rows, args.seeds = rows, [int(s) for s in args.seeds.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.jsonl"
    results = ([json.loads(line) for line in results_file.read_text().splitlines()]
               if results_file.exists() else [])
    extra = args.tfpar_flags.split()
    for row in args.rows:
        spec = ROWS[row]
        corpus = write_corpus(args.data, spec[0], args.out)
        for seed in args.seeds:
            for tool in args.tools.split(","):
                if tool == "pytorch" and spec[3] != "stream":
                    continue  # PyTorch's example has no sentence mode
                name = tool if tool == "pytorch" or not args.tag else f"tfpar {args.tag}"
                if any(r["row"] == row and r["tool"] == name and r["seed"] == seed
                       for r in results):
                    continue
                work = args.out / "runs" / f"{row}-{name.replace(' ', '_')}-{seed}"
                work.mkdir(parents=True, exist_ok=True)
                if tool == "pytorch":
                    r = run_torch(args.torch_python, args.torch_example, corpus, spec, seed,
                                  work)
                else:
                    r = run_tfpar(corpus, spec, seed, work, extra)
                r.update(row=row, tool=name, seed=seed, flags=args.tfpar_flags,
                         date=time.strftime("%Y-%m-%d %H:%M"))
                results.append(r)
                with open(results_file, "a") as f:
                    f.write(json.dumps(r) + "\n")
                print(f"{row} {name} seed {seed}: valid {r['valid_ppl']:.2f} test "
                      f"{r['test_ppl']:.2f} in {r['seconds']:.0f} s", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
