"""Sampled softmax on a huge vocabulary: ``scripts/benchmark.py --sampled-softmax``.

Two generated Zipf corpora (in a temporary folder), each with its vocabulary file in
falling-frequency order (the order the log-uniform sampler assumes)::

    huge   793,471 entries (lm1b's vocabulary size), --softmax sampled --num-sampled 8192
    full   10,000 entries,                            --softmax full

The benchmark's model (the spec's layers, widths, batch and BPTT window, plain SGD, clip
5, stream mode) trains on each, as tfpar's real step (``step.make_train_step(plugin, ...)`` on
``InputData.batches``); the two are timed in interleaved segments like every other
contender (``measure.interleave``), so the ratio compares segments that ran side by side.
Target (:data:`~tfpar.tools.bench.spec.SAMPLED_TARGETS`): the huge vocabulary's tokens/s
at least 1/3 of the 10k one's.

Then the sampled model's valid perplexity, computed by the eval step every training run
uses, which takes the full softmax: logits over all V words (``eval_logits_width``), so
the figure is a true perplexity, next to ``exp`` of the sampled training loss (an
estimate that is no perplexity) and ``V`` (a uniform model's perplexity).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
import time
from typing import Any

import numpy as np

from tfpar.tools.bench.spec import SAMPLED_TARGETS, BenchSpec, target_verdicts

log = logging.getLogger("tfpar.tools.bench")

HUGE_VOCAB = 793_471  # lm1b's vocabulary, specials included
FULL_VOCAB = 10_000
NUM_SAMPLED = 8192


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The two vocabularies, the candidates and the generated corpora's sizes."""

    huge_vocab: int = HUGE_VOCAB
    full_vocab: int = FULL_VOCAB
    num_sampled: int = NUM_SAMPLED
    train_tokens: int = 400_000
    valid_tokens: int = 2_000
    # Stream columns of the valid split's eval batches: the full softmax's logits of one
    # batch are columns x bptt x V floats (4 x 35 x 793,471 x 4 B = 444 MB).
    eval_batch_size: int = 4


TINY = Sizes(huge_vocab=600, full_vocab=60, num_sampled=40, train_tokens=6_000,
             valid_tokens=300, eval_batch_size=4)


def write_zipf_corpus(folder: str, vocab_size: int, *, train_tokens: int, valid_tokens: int,
                      seed: int) -> str:
    """``train.txt``, ``valid.txt``, ``test.txt`` of Zipf-distributed words (P(rank r)
    proportional to 1/(r + 1)) in sentences of 1-40 words, and ``vocab.txt`` (the three
    specials, then the ``vocab_size - 3`` words by rank); returns the vocabulary file."""
    from tfpar.data.vocab import SPECIALS

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = vocab_size - len(SPECIALS)
    names = np.array([f"w{r}" for r in range(words)])
    p = 1.0 / np.arange(1, words + 1)
    cdf = np.cumsum(p / p.sum())
    for split, tokens in (("train", train_tokens), ("valid", valid_tokens),
                          ("test", valid_tokens)):
        ids = np.minimum(np.searchsorted(cdf, rng.random(tokens)), words - 1)
        lengths = rng.integers(1, 41, size=tokens)  # enough sentences for any draw
        ends = np.minimum(np.cumsum(lengths), tokens)
        lines = [" ".join(names[ids[a:b]]) for a, b in zip(np.r_[0, ends[:-1]], ends) if b > a]
        with open(os.path.join(folder, f"{split}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    vocab_file = os.path.join(folder, "vocab.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        f.write("\n".join([*SPECIALS, *names]) + "\n")
    return vocab_file


def run(spec: BenchSpec, sizes: Sizes = Sizes()) -> dict[str, Any]:
    """Both contenders, interleaved; the sampled model's full-softmax valid perplexity;
    the target's verdict."""
    import tensorflow as tf

    from tfpar.config import DistConfig
    from tfpar.objective.losses import perplexity
    from tfpar.objective.step import make_eval_step
    from tfpar.tools.bench.contenders import build_tfpar
    from tfpar.tools.bench.measure import failing_as, interleave
    from tfpar.tools.bench.workload import load_setup
    from tfpar.training.loop import evaluate

    started = time.time()
    runs = {"sampled_huge": (sizes.huge_vocab, "sampled"), "full_10k": (sizes.full_vocab, "full")}
    built = {}
    with tempfile.TemporaryDirectory(prefix="tfpar-sampled-") as tmp:
        for name, (vocab_size, softmax) in runs.items():
            folder = os.path.join(tmp, name)
            vocab_file = write_zipf_corpus(folder, vocab_size, train_tokens=sizes.train_tokens,
                                           valid_tokens=sizes.valid_tokens, seed=spec.seed)
            run_spec = dataclasses.replace(
                spec, data=folder, softmax=softmax,
                num_sampled=sizes.num_sampled if softmax == "sampled" else None)
            with failing_as(name):
                setup = load_setup(run_spec, vocab_file=vocab_file)
                contender, plugin = build_tfpar(setup, name, DistConfig())
                contender.warm_up(spec.warmup)
            built[name] = (setup, contender, plugin)
            log.info("%s: vocabulary %d, softmax %s", name, len(setup.vocab), softmax)
        rates = interleave([c for _, c, _ in built.values()], spec)
        setup, contender, plugin = built["sampled_huge"]
        model = contender.model
        eval_start = time.perf_counter()
        nll, count = evaluate(plugin, make_eval_step(plugin, model), setup.stream_data, "valid",
                              sizes.eval_batch_size)
        eval_seconds = time.perf_counter() - eval_start
        width = int(model(tf.zeros([1, 1], tf.int32))[0].shape[-1])
        sampled_loss = _sampled_train_loss(contender)
    huge, full = rates["sampled_huge"], rates["full_10k"]
    results: dict[str, Any] = {
        "sizes": dataclasses.asdict(sizes),
        "model": {"layers": spec.layers, "embed_dim": spec.embed_dim,
                  "hidden_dim": spec.hidden_dim, "batch_size": spec.batch_size,
                  "bptt": spec.bptt, "optimizer": spec.optimizer, "tie_embeddings": False,
                  "mode": "stream"},
        "rounds": spec.rounds, "steps": spec.steps,
        "sampled_huge": {**huge, "vocab_size": len(built["sampled_huge"][0].vocab),
                         "softmax": "sampled", "num_sampled": sizes.num_sampled},
        "full_10k": {**full, "vocab_size": len(built["full_10k"][0].vocab), "softmax": "full"},
        "sampled_huge_vs_full_10k": huge["tokens_per_sec"] / full["tokens_per_sec"],
        "eval": {"softmax": "full", "eval_logits_width": width, "valid_ppl": perplexity(nll, count),
                 "valid_tokens": count, "seconds": eval_seconds,
                 "exp_sampled_train_loss": sampled_loss,
                 "uniform_ppl": float(len(built["sampled_huge"][0].vocab))},
        "seconds": time.time() - started,
    }
    results["targets"] = target_verdicts(results, SAMPLED_TARGETS)
    return results


def _sampled_train_loss(contender) -> float:
    """``exp(nll_sum / count)`` of one more sampled training step (the estimate training
    sees; not a perplexity)."""
    out = next(contender._outputs)
    return float(math.exp(float(out.nll_sum) / max(float(out.count), 1.0)))


def format_report(results: dict[str, Any]) -> str:
    m, e = results["model"], results["eval"]
    lines = [
        f"sampled softmax: {m['layers']}x{m['hidden_dim']} LSTM, embedding {m['embed_dim']}, "
        f"untied, batch {m['batch_size']} x bptt {m['bptt']}, {m['optimizer']}; "
        f"{results['rounds']} interleaved rounds of {results['steps']} steps",
        f"{'contender':<14}{'vocabulary':>12}{'softmax':>18}{'tokens/s':>10}{'step ms':>9}",
    ]
    for name in ("sampled_huge", "full_10k"):
        r = results[name]
        how = f"sampled K={r['num_sampled']}" if r["softmax"] == "sampled" else "full"
        lines.append(f"{name:<14}{r['vocab_size']:>12,}{how:>18}{r['tokens_per_sec']:>10,.0f}"
                     f"{1000 * r['step_seconds']:>9.1f}")
    lines.append(f"valid perplexity of the sampled model, full softmax over "
                 f"{e['eval_logits_width']:,} words: {e['valid_ppl']:,.1f} "
                 f"({e['valid_tokens']:.0f} tokens, {e['seconds']:.1f} s; a uniform model: "
                 f"{e['uniform_ppl']:,.0f}; exp(sampled training loss) "
                 f"{e['exp_sampled_train_loss']:,.1f} is no perplexity)")
    for name, t in results["targets"].items():
        lines.append(f"{'PASS' if t['pass'] else 'FAIL'} {name} = {t['value']:.3f} "
                     f"(target {t['target']})")
    return "\n".join(lines)
