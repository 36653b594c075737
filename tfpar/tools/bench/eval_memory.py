"""Evaluation's memory at large vocabularies: ``scripts/benchmark.py --eval-memory``.

For each vocabulary size V, two child processes evaluate the same model (the benchmark's
2 x 200 LSTM, untied, the same seed) on the same generated token ids, through the eval
step every training run uses, in evaluation batches of 20 x 35 = 700 tokens: one with the
fused softmax (``tfpar.objective.fused``: its default blocks, at most 1024 x 131,072 logits) and one
with ``--no-fused-softmax`` (the [700, V] logits, then the cross-entropy: 2.2 GB of
float32 logits at V = 793,471). Each child reports its peak resident memory over the whole
process (``ru_maxrss``: building the model included), its growth over the evaluation
(VmHWM from the built model on: tracing, compiling and the batches; the model's weights,
two V x 200 matrices, are in both), and the perplexity, which the two must agree on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence

VOCABS = (10_000, 100_000, 793_471)
ROWS, STEPS = 20, 35  # one evaluation batch: 700 tokens
BATCHES = 2


def _status_mb(field: str) -> float | None:
    """``field`` (VmRSS, VmHWM) of /proc/self/status in MB; None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Resets the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(vocab_size: int, fused: bool, *, rows: int = ROWS, steps: int = STEPS,
          batches: int = BATCHES, seed: int = 0, layers: int = 2, width: int = 200
          ) -> dict[str, Any]:
    """One evaluation in this process (a fresh one: the peaks are the process's)."""
    import resource

    import tensorflow as tf

    from tfpar.config import DistConfig, ModelConfig
    from tfpar.model.lm import build_model
    from tfpar.objective.losses import perplexity
    from tfpar.objective.step import make_eval_step
    from tfpar.parallel.registry import build_strategy

    plugin = build_strategy(DistConfig())
    config = ModelConfig(layers=layers, embed_dim=width, hidden_dim=width,
                         dropout=0.0, tie_embeddings=False, init_scale=0.0,
                         fused_softmax=fused)
    with plugin.scope():
        model = build_model(config, vocab_size, seed=seed)
    eval_step = make_eval_step(plugin, model)
    ids = tf.random.stateless_uniform([batches, rows, steps + 1], [seed, 1], 1, vocab_size,
                                      dtype=tf.int32)
    weights_mb = sum(v.numpy().nbytes for v in model.weights) / 2**20

    def batch(b):
        return {"inputs": ids[b, :, :-1], "targets": ids[b, :, 1:]}

    before = _status_mb("VmRSS")
    reset = _reset_peak()
    nll = count = 0.0
    for b in range(batches):
        out = eval_step(batch(b))
        nll, count = nll + float(out.nll_sum), count + float(out.count)
    peak = _status_mb("VmHWM")
    return {
        "vocab_size": vocab_size, "fused": fused, "tokens": count,
        "perplexity": perplexity(nll, count), "nll_sum": nll,
        "weights_mb": weights_mb, "rss_before_eval_mb": before,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "eval_peak_rss_mb": peak if reset else None,
        "eval_peak_over_start_mb": (peak - before) if reset and before is not None else None,
    }


def run_child(vocab_size: int, fused: bool) -> dict[str, Any]:
    """:func:`child` in a new process (``python -m tfpar.tools.bench``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tfpar.tools.bench", "--eval-memory-child",
         f"{vocab_size},{int(fused)}"],
        capture_output=True, text=True, timeout=3600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode != 0:
        raise RuntimeError(f"the evaluation at V={vocab_size} (fused={fused}) exited "
                           f"{proc.returncode}: {proc.stderr.strip()[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve_child(arg: str) -> int:
    """``--eval-memory-child V,FUSED``: prints :func:`child`'s result as one JSON line."""
    vocab, fused = (int(x) for x in arg.split(","))
    print(json.dumps(child(vocab, bool(fused))))
    return 0


def run(vocabs: Sequence[int] = VOCABS) -> dict[str, Any]:
    """Both paths at every vocabulary size, and their ratios."""
    out: dict[str, Any] = {"rows": ROWS * STEPS, "batches": BATCHES, "vocabs": {}}
    for vocab in vocabs:
        fused, unfused = run_child(vocab, True), run_child(vocab, False)
        row = {"fused": fused, "unfused": unfused,
               "peak_rss_ratio": fused["peak_rss_mb"] / unfused["peak_rss_mb"],
               "perplexity_rel_diff": abs(fused["perplexity"] / unfused["perplexity"] - 1)}
        if fused["eval_peak_over_start_mb"] is not None:
            row["eval_growth_ratio"] = (max(fused["eval_peak_over_start_mb"], 0.0)
                                        / max(unfused["eval_peak_over_start_mb"], 1e-9))
        out["vocabs"][str(vocab)] = row
    return out


def format_report(results: dict[str, Any]) -> str:
    lines = [f"evaluation memory: {results['batches']} batches of {results['rows']} tokens, "
             "2 x 200 LSTM, untied; peak RSS of the process (and its growth during the "
             "evaluation), fused vs --no-fused-softmax",
             f"{'V':>9}{'weights MB':>12}{'fused MB':>16}{'unfused MB':>18}{'ratio':>8}"
             f"{'ppl rel diff':>14}"]
    for vocab, row in results["vocabs"].items():
        f, u = row["fused"], row["unfused"]

        def mb(r):
            growth = r["eval_peak_over_start_mb"]
            return f"{r['peak_rss_mb']:,.0f}" + (f" (+{growth:,.0f})" if growth is not None
                                                 else "")

        lines.append(f"{int(vocab):>9,}{f['weights_mb']:>12,.0f}{mb(f):>16}{mb(u):>18}"
                     f"{row['peak_rss_ratio']:>8.3f}{row['perplexity_rel_diff']:>14.2e}")
    return "\n".join(lines)
