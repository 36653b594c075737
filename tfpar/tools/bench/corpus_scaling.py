"""How a run's memory and start-up grow with the corpus: ``--corpus-scaling 1,20,100``.

For every factor ``k`` the train split of a corpus folder (WikiText-2 by default) is
written ``k`` times into a temporary folder (valid and test once), and
``scripts/train.py --strategy mirrored --max-steps 50`` runs on it twice, each in a
process of its own: once building the vocabulary from the train split, once given the
first run's ``vocab.txt`` (``--vocab-file``). Reported per run:

* peak RSS of the training process (``wait4``'s ``ru_maxrss``);
* time from the process's start to its first training step done;
* seconds reading the corpus and making the vocabulary, and the vocabulary pass's MB/s
  (train bytes over its seconds);
* training tokens/s over the 50 steps (``metrics.json``).

The targets (the Corpus issue): peak RSS at the largest factor at most 1.2x that at 1x,
and, with ``--vocab-file``, time to the first step at the largest factor at most 1.5x
that at 1x.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from tfpar.data.corpora import SPLIT_PATTERNS, SPLITS
from tfpar.errors import ConfigError, command
from tfpar.parallel.cluster.local_job import TRAIN_MODULE, package_env
from tfpar.tools.bench.spec import target_verdicts

# Where tfpar-download wikitext-2 puts it, under the working directory (tfpar-train's
# --data wikitext-2).
DEFAULT_CORPUS = os.path.join("input", "wikitext-2")
TARGETS = {"rss_largest_vs_1x": ("<=", 1.2), "first_step_largest_vs_1x_vocab_file": ("<=", 1.5)}


def split_files(corpus: str) -> dict[str, str]:
    """split -> its file in ``corpus``.

    Raises:
      ConfigError: the folder is missing or lacks one of the splits.
    """
    if not os.path.isdir(corpus):
        how = (f"download it with: {command('tfpar-download', 'wikitext-2')}, or pass "
               "--scaling-corpus DIR" if corpus == DEFAULT_CORPUS else
               "pass a folder holding a corpus's train, valid and test files")
        raise ConfigError(f"--scaling-corpus {corpus!r} is not a folder; {how}")
    found = {}
    for split in SPLITS:
        names = [pattern.format(split) for pattern in SPLIT_PATTERNS]  # a corpus folder's
        for name in names:
            path = os.path.join(corpus, name)
            if os.path.isfile(path):
                found[split] = path
                break
        else:
            raise ConfigError(f"--scaling-corpus {corpus!r} has no {split} file (expected one "
                              f"of {', '.join(names)})")
    return found


def repeat_corpus(files: dict[str, str], factor: int, folder: str) -> int:
    """Writes train ``factor`` times (valid, test once) into ``folder`` as
    ``{train,valid,test}.txt``; returns the train split's bytes."""
    os.makedirs(folder, exist_ok=True)
    for split, path in files.items():
        target = os.path.join(folder, f"{split}.txt")
        with open(target, "wb") as out:
            for _ in range(factor if split == "train" else 1):
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
    return os.path.getsize(os.path.join(folder, "train.txt"))


def train_once(data: str, model_dir: str, *, steps: int, vocab_file: str | None = None,
               extra: Sequence[str] = ()) -> dict[str, Any]:
    """One ``tfpar-train`` process (``python -m tfpar.tools.train``): its metrics, peak RSS (MB) and seconds from its
    start to its first step."""
    metrics_path = os.path.join(model_dir + ".json")
    cmd = [sys.executable, "-m", TRAIN_MODULE, "--data", data,
           "--strategy", "mirrored", "--max-steps", str(steps), "--no-export", "--no-progress",
           "--model-dir", model_dir, "--metrics-json", metrics_path, *extra]
    if vocab_file:
        cmd += ["--vocab-file", vocab_file]
    env = package_env({**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read().decode("utf-8", "replace")
    proc.stderr.close()
    if status or not os.path.exists(metrics_path):
        tail = " | ".join(stderr.strip().splitlines()[-2:])
        raise RuntimeError(f"train.py on {data} failed (status {status}): {tail}")
    with open(metrics_path, encoding="utf-8") as f:
        metrics = json.load(f)
    first = metrics.get("first_step_time")
    return {"peak_rss_mb": usage.ru_maxrss / 1024.0,  # KB on Linux
            "seconds_to_first_step": first - started if first else None,
            "corpus_seconds": metrics.get("corpus_seconds"),
            "vocab_seconds": metrics.get("vocab_seconds"),
            "tokens_per_sec": metrics.get("tokens_per_sec"),
            "wall_seconds": time.time() - started}


def run(factors: Sequence[int], *, corpus: str = DEFAULT_CORPUS, steps: int = 50,
        extra: Sequence[str] = ()) -> dict[str, Any]:
    """Every factor, with and without ``--vocab-file``; and the two target ratios."""
    files = split_files(corpus)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tfpar-corpus-scaling-") as tmp:
        for k in factors:
            folder = os.path.join(tmp, f"x{k}")
            train_bytes = repeat_corpus(files, k, folder)
            built = train_once(folder, os.path.join(tmp, f"run{k}"), steps=steps, extra=extra)
            given = train_once(folder, os.path.join(tmp, f"run{k}v"), steps=steps, extra=extra,
                               vocab_file=os.path.join(tmp, f"run{k}", "vocab.txt"))
            built["vocab_mb_per_sec"] = (train_bytes / 1e6 / built["vocab_seconds"]
                                         if built["vocab_seconds"] else None)
            rows.append({"factor": k, "train_mb": train_bytes / 1e6, "built": built,
                         "vocab_file": given})
            shutil.rmtree(folder)
    first, last = rows[0], rows[-1]
    results = {"corpus": corpus, "steps": steps, "rows": rows,
               "rss_largest_vs_1x": last["built"]["peak_rss_mb"] / first["built"]["peak_rss_mb"],
               "first_step_largest_vs_1x_vocab_file": (
                   last["vocab_file"]["seconds_to_first_step"]
                   / first["vocab_file"]["seconds_to_first_step"])}
    results["targets"] = target_verdicts(results, TARGETS)
    return results


def format_report(results: dict[str, Any]) -> str:
    lines = [f"corpus scaling: {results['corpus']} train split repeated, {results['steps']} "
             "steps of tfpar-train --strategy mirrored each",
             f"{'factor':>6}{'train MB':>10}{'vocab':>11}{'peak RSS MB':>13}"
             f"{'first step s':>14}{'vocab s':>9}{'vocab MB/s':>12}{'tokens/s':>10}"]
    for r in results["rows"]:
        for label, run in (("built", r["built"]), ("file", r["vocab_file"])):
            mbs = run.get("vocab_mb_per_sec")
            lines.append(
                f"{r['factor']:>6}{r['train_mb']:>10.1f}{label:>11}{run['peak_rss_mb']:>13,.0f}"
                f"{run['seconds_to_first_step']:>14.1f}{run['vocab_seconds']:>9.2f}"
                f"{(f'{mbs:.1f}' if mbs else '-'):>12}{run['tokens_per_sec'] or 0:>10,.0f}")
    for name, t in results["targets"].items():
        lines.append(f"{'PASS' if t['pass'] else 'FAIL'} {name} = {t['value']:.3f} "
                     f"(target {t['target']})")
    return "\n".join(lines)
