"""The benchmark's command line: ``tfpar-benchmark`` (``scripts/benchmark.py`` in a clone)
and ``python -m tfpar.tools.bench`` (also its child processes)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from tfpar.tools.bench.spec import DEFAULT_PTB, BenchSpec, quick_spec, tiny_spec
from tfpar.tools.parsing import Parser


def parser(prog: str = "tfpar-benchmark") -> argparse.ArgumentParser:
    p = Parser(
        allow_abbrev=False, prog=prog,
        description="Training throughput of tfpar against plain Keras, the input pipeline's "
                    "share, padding, and the cost of distribution, measured side by side.")
    p.add_argument("--data", default=DEFAULT_PTB,
                   help="the corpus, as tfpar-train's --data: ptb (input/ptb/, fetched by "
                        "tfpar-download ptb), a folder, or 'synthetic' for the generated "
                        "corpus (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer rounds (a few minutes)")
    p.add_argument("--tiny", action="store_true",
                   help="a generated corpus and a toy model: seconds (for tests)")
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds (0: by mode)")
    p.add_argument("--steps", type=int, default=0, help="timed steps per segment (0: by mode)")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 for the tfpar contenders")
    p.add_argument("--optimizer", default="sgd",
                   help="sgd | adam, for every contender (default: %(default)s, as in "
                        "ptb_word_lm.py's small configuration)")
    p.add_argument("--json", default="", help="write the results to this JSON file")
    p.add_argument("--plot", default="", help="write a PNG chart here (needs matplotlib)")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("-v", "--verbose", action="store_true", help="TensorFlow's own logs too")
    p.add_argument("--loopback-workers", default="",
                   help="comma-separated worker counts, e.g. 2,3: check the scaling model "
                        "against that many multi_worker processes on loopback (about a "
                        "minute each; default: none)")
    p.add_argument("--corpus-scaling", default="",
                   help="comma-separated factors, e.g. 1,20,100: instead of the throughput "
                        "benchmark, train 50 steps on the --scaling-corpus train split "
                        "repeated that many times (with and without --vocab-file) and report "
                        "peak RSS, time to the first step, vocabulary MB/s and tokens/s")
    p.add_argument("--scaling-corpus", default="",
                   help="corpus folder for --corpus-scaling (default: input/wikitext-2, "
                        "fetched by tfpar-download wikitext-2)")
    p.add_argument("--sampled-softmax", action="store_true",
                   help="instead of the throughput benchmark: training tokens/s with a "
                        "793,471-word vocabulary and --softmax sampled --num-sampled 8192 "
                        "against a 10k vocabulary with the full softmax (same model, "
                        "generated Zipf corpora, interleaved rounds; target: ratio >= 1/3), "
                        "and the sampled model's valid perplexity under the full softmax "
                        "(--tiny: toy vocabularies)")
    p.add_argument("--eval-memory", nargs="?", const="10000,100000,793471", default="",
                   metavar="VOCABS",
                   help="instead of the throughput benchmark: peak memory and perplexity "
                        "of evaluation with the fused softmax and with --no-fused-softmax, "
                        "each in its own process, at these comma-separated vocabulary sizes "
                        "(default when given alone: %(const)s)")
    p.add_argument("--eval-memory-child", default="", help=argparse.SUPPRESS)  # internal
    p.add_argument("--serve", default="", help=argparse.SUPPRESS)  # child process (internal)
    p.add_argument("--worker-task", default="", help=argparse.SUPPRESS)  # loopback worker
    return p


def spec_from_args(a: argparse.Namespace) -> BenchSpec:
    overrides: dict[str, Any] = {"precision": a.precision, "optimizer": a.optimizer}
    if a.rounds:
        overrides["rounds"] = a.rounds
    if a.steps:
        overrides["steps"] = a.steps
    if a.tiny:
        return tiny_spec(**overrides)
    overrides["data"] = a.data
    return quick_spec(**overrides) if a.quick else BenchSpec(**overrides)


def counts_flag(flag: str, text: str, *, least: int) -> tuple[int, ...]:
    """``"2,3"`` -> (2, 3) for a flag of comma-separated integers >= ``least``.

    Raises:
      ConfigError: anything else.
    """
    from tfpar.errors import ConfigError

    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        counts = ()
    if text.strip() and (not counts or min(counts) < least):
        raise ConfigError(f"{flag} {text!r} must be comma-separated integers of at least "
                          f"{least}, e.g. {least},{least + 1}")
    return counts


def loopback_counts(text: str) -> tuple[int, ...]:
    """``--loopback-workers 2,3`` -> (2, 3) (worker counts of at least 2)."""
    return counts_flag("--loopback-workers", text, least=2)


def corpus_scaling_main(args: argparse.Namespace) -> int:
    """``--corpus-scaling``: prints the table (and writes ``--json``); exit 1 under
    ``--check`` when a target is missed."""
    from tfpar.tools.bench import corpus_scaling
    from tfpar.tools.bench.report import write_json

    factors = counts_flag("--corpus-scaling", args.corpus_scaling, least=1)
    results = corpus_scaling.run(factors, corpus=args.scaling_corpus
                                 or corpus_scaling.DEFAULT_CORPUS)
    print(corpus_scaling.format_report(results))
    if args.json:
        write_json(args.json, results)
    missed = [n for n, t in results["targets"].items() if not t["pass"]]
    return 1 if args.check and missed else 0


def sampled_softmax_main(args: argparse.Namespace) -> int:
    """``--sampled-softmax``: prints the report (and writes ``--json``); exit 1 under
    ``--check`` when the target is missed."""
    from tfpar.parallel import devices
    from tfpar.tools.bench import sampled
    from tfpar.tools.bench.report import write_json

    devices.configure_cpu_devices(1)
    results = sampled.run(spec_from_args(args), sampled.TINY if args.tiny else sampled.Sizes())
    print(sampled.format_report(results))
    if args.json:
        write_json(args.json, results)
    missed = [n for n, t in results["targets"].items() if not t["pass"]]
    return 1 if args.check and missed else 0


def eval_memory_main(args: argparse.Namespace) -> int:
    """``--eval-memory``: prints the table (and writes ``--json``)."""
    from tfpar.tools.bench import eval_memory
    from tfpar.tools.bench.report import write_json

    results = eval_memory.run(counts_flag("--eval-memory", args.eval_memory, least=2))
    print(eval_memory.format_report(results))
    if args.json:
        write_json(args.json, results)
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-benchmark``: exit 0; 1 when a contender failed (``error: contender
    <name> failed: ...`` on stderr, one line each) or, under ``--check``, a target is
    missed; 2 on a usage error."""
    from tfpar.tools.cli import run_main, setup_logging

    args = parser(prog or "tfpar-benchmark").parse_args(argv)
    setup_logging(args.verbose)
    if args.worker_task:
        from tfpar.tools.bench.workers import serve_worker

        return serve_worker(args.worker_task)
    if args.serve:
        from tfpar.tools.bench.remote import serve

        return serve(args.serve)
    if args.eval_memory_child:
        from tfpar.tools.bench.eval_memory import serve_child

        return serve_child(args.eval_memory_child)

    def body():
        if args.corpus_scaling:
            return corpus_scaling_main(args)
        if args.sampled_softmax:
            return sampled_softmax_main(args)
        if args.eval_memory:
            return eval_memory_main(args)
        spec = spec_from_args(args)
        from tfpar.parallel import devices
        from tfpar.tools.bench.contenders import ContenderFailed
        from tfpar.tools.bench.measure import run
        from tfpar.tools.bench.report import (failed_contenders, format_report, write_json,
                                              write_plot)

        devices.configure_cpu_devices(1)  # the 2-device contenders run in a child process
        try:
            results = run(spec, loopback=loopback_counts(args.loopback_workers))
        except ContenderFailed as e:  # nothing to report: the run stopped there
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(format_report(results))
        if args.json:
            write_json(args.json, results)
        if args.plot:
            write_plot(args.plot, results)
        failed = failed_contenders(results)
        for name, why in failed.items():
            print(f"error: {ContenderFailed(name, why)}", file=sys.stderr)
        if failed:
            return 1
        missed = [n for n, t in results["targets"].items() if not t["pass"]]
        return 1 if args.check and missed else 0

    return run_main(body)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
