"""The benchmark's pure parts, and one tiny end-to-end run of scripts/benchmark.py."""

import contextlib
import io
import json
import math
import sys

import numpy as np
import pytest

from conftest import REPO, model_config
from tfpar.tools.bench import contenders, measure, remote, report, spec as bench_spec
from tfpar.tools.bench.contenders import ContenderFailed, Segment
from tfpar.tools.bench.measure import pad_fraction, ratio, stall_fraction
from tfpar.tools.bench.spec import BenchSpec, check_targets, tiny_spec
from tfpar.tools.bench.workload import fixed_windows, load_setup
from tfpar.errors import ConfigError, DataError


def _load_script():
    """scripts/benchmark.py as a module (scripts/ is not a package)."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        "benchmark_script", os.path.join(REPO, "scripts", "benchmark.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


main = _load_script().main

KEYS = ("tfpar_tokens_per_sec", "keras_baseline_tokens_per_sec", "tfpar_vs_keras_baseline",
        "input_stall_fraction", "input_stall_fraction_ab", "pad_fraction_bucketed",
        "pad_fraction_naive",
        "mirrored1_vs_default")


def test_pad_fraction():
    assert pad_fraction(90, 100) == pytest.approx(0.1)
    assert pad_fraction(100, 100) == 0.0
    assert pad_fraction(0, 0) == 0.0


def test_input_wait_fraction_is_the_extra_fetch_time_share_of_tfdata_steps():
    Seg = Segment
    pairs = [(Seg(1, 0.098, 0.1, 0.001), Seg(1, 0.1, 0.1, 0.003))] * 4
    assert measure.input_wait_fraction(pairs) == pytest.approx(0.02)
    faster = [(Seg(1, 0.1, 0.1, 0.004), Seg(1, 0.1, 0.1, 0.001))]
    assert measure.input_wait_fraction(faster) == 0.0


def test_stall_fraction_is_the_extra_time_share_clipped_at_zero():
    assert stall_fraction(0.9, 1.0) == pytest.approx(0.1)
    assert stall_fraction(1.2, 1.0) == 0.0  # noise: tf.data-fed step measured faster
    assert stall_fraction(1.0, 0.0) == 0.0


def test_ratio_of_missing_values_is_none():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio("not available", 2.0) is None and ratio(1.0, None) is None


def test_targets_pass_at_the_threshold_and_fail_past_it_or_when_missing():
    good = {"tfpar_vs_keras_baseline": 1.7, "input_stall_fraction": 0.02,
            "pad_fraction_bucketed": 0.0, "mirrored1_vs_default": 0.95,
            "mirrored2_vs_default": 1.0, "default_fraction_of_limit": 0.80,
            "output_layer_fp32_stream_fraction_of_limit": 0.85,
            "bf16_vs_fp32": 1.35, "spe10_vs_1": 1.02}
    assert set(good) == set(bench_spec.TARGETS)
    assert all(row[-1] for row in check_targets(good))
    bad = {**good, "tfpar_vs_keras_baseline": 1.69, "input_stall_fraction": 0.021,
           "mirrored1_vs_default": None, "default_fraction_of_limit": 0.799}
    failed = {row[0] for row in check_targets(bad) if not row[-1]}
    assert failed == {"tfpar_vs_keras_baseline", "input_stall_fraction", "mirrored1_vs_default",
                      "default_fraction_of_limit"}
    assert not check_targets({**good, "pad_fraction_bucketed": math.nan})[2][-1]


def test_fixed_windows_cut_the_stream_and_shift_the_targets():
    x, y = fixed_windows(np.arange(11), 3)
    np.testing.assert_array_equal(x, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    np.testing.assert_array_equal(y, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])


def test_spec_errors_name_the_bad_value():
    with pytest.raises(ConfigError, match="--steps must be >= 1, got 0"):
        BenchSpec(steps=0)
    with pytest.raises(ConfigError, match="unknown precision 'fp16'; expected fp32 or bf16"):
        BenchSpec(precision="fp16")
    with pytest.raises(ConfigError, match="unknown optimizer 'rmsprop'; expected sgd or adam"):
        BenchSpec(optimizer="rmsprop")
    with pytest.raises(ConfigError, match="warmup must be >= 2"):
        BenchSpec(warmup=1)


class FakeContender(contenders.Contender):
    """Steps that take a fixed time; records the order it was called in."""

    def __init__(self, name, seconds, calls):
        self.name, self.seconds, self.calls = name, seconds, calls

    def step(self):
        self.calls.append(self.name)
        return Segment(10.0, self.seconds, self.seconds)

    def segment(self, steps):
        self.calls.append(self.name)
        return Segment(10.0 * steps, self.seconds * steps, self.seconds * steps)


def test_paired_steps_alternate_the_order_and_give_time_ratios():
    calls = []
    a, b = FakeContender("a", 0.3, calls), FakeContender("b", 0.2, calls)
    assert measure.paired_step_ratios(a, b, 3) == pytest.approx([1.5, 1.5, 1.5])
    assert calls == ["a", "b", "b", "a", "a", "b"]


def test_paired_segments_give_rates_of_both_sides():
    calls = []
    a, b = FakeContender("a", 0.5, calls), FakeContender("b", 0.25, calls)
    rates_a, rates_b = measure.paired_segment_rates(a, b, tiny_spec(rounds=2, steps=4))
    assert rates_a == pytest.approx([20.0, 20.0]) and rates_b == pytest.approx([40.0, 40.0])
    assert calls == ["a", "b", "b", "a"]


def test_bad_flag_value_exits_2(capsys):
    assert main(["--tiny", "--precision", "fp16"]) == 2
    assert "error: unknown precision 'fp16'" in capsys.readouterr().err


def test_missing_ptb_is_one_line_naming_the_download_and_data(tmp_path, monkeypatch, capsys):
    """The default corpus is PTB where tfpar-download puts it (input/ptb/ under the working
    directory), never a folder outside it; missing, the run stops with tfpar-train's
    one-line error, and a missing --data folder is an error too: no other corpus is
    measured in its place."""
    monkeypatch.chdir(tmp_path)
    assert bench_spec.BenchSpec().data == "ptb"
    assert main(["--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: corpus 'ptb' is missing: input/ptb does not exist; download it "
                   "with: tfpar-download ptb (from a clone: python scripts/download_data.py "
                   "ptb), or pass --data DIR")
    with pytest.raises(DataError, match=r"^data source '.*/nowhere' is not a known corpus"):
        load_setup(tiny_spec(data=str(tmp_path / "nowhere")))


def test_bucketing_pads_far_less_than_padded_batch_on_the_same_sentences():
    """The buckets pad at most 2% (--max-pad-fraction); the epoch's leftover rows, one
    partial batch per bucket mixed into batches of all lengths (so that the epoch does not
    end with its longest sentences), pad to their longest: on 2,000 sentences in 44
    buckets the epoch pads 9.3% against padded_batch's 47% (400 sentences: 24% / 45%)."""
    pads = measure.padding(load_setup(tiny_spec(synthetic_sentences=2000)))
    assert pads["pad_fraction_bucketed"] <= 0.12
    assert pads["pad_fraction_naive"] > 0.3
    assert pads["bucket_count"] > 1


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One --quick --tiny --check run (seconds on an idle host); its exit code, JSON and
    printed report. The stderr of a run that stopped early is in the failure message."""
    out = tmp_path_factory.mktemp("bench")
    path = out / "b.json"
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(["--quick", "--tiny", "--check", "--json", str(path)])
    stderr = errors.getvalue()
    assert path.exists(), f"the benchmark exited {code} without results: " + " | ".join(
        line for line in stderr.splitlines() if line.startswith("error:"))
    return code, json.loads(path.read_text()), printed.getvalue(), stderr


def test_tiny_run_has_no_failed_contender(tiny_run):
    """Every registered strategy built, warmed up and was timed; a crash fails here."""
    code, results, _, stderr = tiny_run
    assert report.failed_contenders(results) == {}
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == []
    assert code in (0, 1)  # 1 only for a missed target (--check), see below


def test_tiny_run_writes_every_key(tiny_run):
    _, results, _, _ = tiny_run
    for key in KEYS:
        assert key in results, key
    assert results["corpus"] == "synthetic"
    assert results["tfpar_tokens_per_sec"] > 0 and results["keras_baseline_tokens_per_sec"] > 0
    assert results["tfpar_vs_keras_baseline"] == pytest.approx(
        results["tfpar_tokens_per_sec"] / results["keras_baseline_tokens_per_sec"])
    assert 0.0 <= results["input_stall_fraction"] < 1.0
    assert results["pad_fraction_bucketed"] < results["pad_fraction_naive"]
    assert set(results["distribution_tokens_per_sec"]) == {
        "default", "mirrored1", "mirrored2", "tower2", "pipeline2"}
    for name, value in results["distribution_tokens_per_sec"].items():
        assert isinstance(value, float) or value == bench_spec.NOT_AVAILABLE, (name, value)
    assert isinstance(results["distribution_tokens_per_sec"]["mirrored1"], float)
    # The two-device contenders ran in their own process, and mirrored is the headline.
    assert isinstance(results["distribution_tokens_per_sec"]["mirrored2"], float)
    assert results["tfpar_strategy"] == "mirrored"
    assert results["tfpar_vs_keras_baseline"] == results["tfpar_mirrored_vs_keras_baseline"]
    assert results["tfpar_default_vs_keras_baseline"] > 0


def test_tiny_run_reports_the_roofline_bf16_and_steps_per_call(tiny_run):
    _, results, printed, _ = tiny_run
    roof = results["roofline"]
    side = results["side_by_side_tokens_per_sec"]
    assert set(roof["fraction_of_limit"]) == set(side)
    assert {"default_bf16", "default_spe10", "default_unfused"} <= set(side)
    for name, rate in side.items():
        limit = roof["limit_tokens_per_sec"]["bf16" if name == "default_bf16" else "fp32"]
        assert roof["fraction_of_limit"][name] == pytest.approx(rate / limit)
        assert roof["gflops"][name] == pytest.approx(rate * roof["flops_per_token"] / 1e9)
    assert results["default_fraction_of_limit"] == roof["fraction_of_limit"]["default"]
    assert all(v > 0 for table in roof["matmul_gflops"].values() for v in table.values())
    assert results["bf16_vs_fp32"] > 0 and len(results["bf16_vs_fp32_per_round"]) == 1
    assert results["spe10_vs_1"] > 0 and results["host_overhead_ms_per_step"] >= 0
    assert set(results["spe_step_ms"]) == set(results["probe_step_ms"]) == {"1", "10"}
    assert results["spe10_gain_at_5ms_step"] == pytest.approx(
        measure.gain_at(0.005, results["host_overhead_ms_per_step"] / 1e3, 10))
    # The step split: both precisions, each part measured and at its matmul limit; the
    # parts and the rest add up to the measured default step.
    for precision in ("fp32", "bf16"):
        row = results["breakdown"][precision]
        assert set(row) == {"softmax", "softmax_unfused", "rnn", "rest", "step"}
        assert row["softmax"]["ms"] > 0 and row["rnn"]["limit_ms"] > 0
        assert row["softmax"]["limit_ms"] == row["softmax_unfused"]["limit_ms"] > 0
        assert sum(row[p]["ms"] for p in ("softmax", "rnn", "rest")) == pytest.approx(
            row["step"]["ms"])
        sentence = results["breakdown_sentence"][precision]
        assert set(sentence) == {"softmax", "softmax_unfused", "rnn"}
        for mode, table in (("stream", row), ("sentence", sentence)):
            for part in ("softmax", "softmax_unfused"):
                name = f"{part.replace('softmax', 'output_layer')}_{precision}_{mode}"
                assert results[f"{name}_fraction_of_limit"] == table[part]["fraction"] > 0
    assert results["fused_vs_unfused"] == pytest.approx(
        side["default"] / side["default_unfused"])
    assert results["breakdown"]["fp32"]["step"]["ms"] == pytest.approx(
        1e3 * 80 / results["side_by_side_tokens_per_sec"]["default"])
    assert "roofline:" in printed and "steps per call:" in printed and "bf16 vs fp32" in printed
    assert "step breakdown, fp32, stream mode" in printed and "scaling model:" in printed
    assert "step breakdown, bf16, sentence mode" in printed
    assert "output layer, fraction of its matmul limit: " in printed


def test_host_overhead_is_what_n_steps_per_call_save_per_step():
    # 10 ms of work plus 1 ms between steps: 11 ms a step with 1 per call, 10.1 with 10.
    assert measure.host_overhead(0.011, 0.0101, 10) == pytest.approx(0.001)
    assert measure.host_overhead(0.010, 0.0102, 10) == 0.0  # noise: 10 per call slower
    # A 5 ms step with 1 ms of it on the host: 5 / 4.1 with 10 per call.
    assert measure.gain_at(0.005, 0.001, 10) == pytest.approx(5 / 4.1)


def test_step_flops_count_every_matmul_of_the_step():
    from tfpar.tools.bench import roofline

    mms = roofline.step_matmuls(layers=2, embed_dim=200, hidden_dim=200, vocab_size=10000,
                                batch_size=20, bptt=35)
    # 6HV for the softmax, 24 H (D + H) per layer: 15.84 MFLOP per token (module docstring).
    per_token = roofline.step_flops(mms) / 700
    assert per_token == pytest.approx(6 * 200 * 10000 + 2 * 24 * 200 * 400)
    assert sum(m.loop for m in mms) == 4 and all(not m.large for m in mms if m.loop)
    rates = {"float32": {roofline.shape_key(m): 1e11 for m in mms},
             "bfloat16": {roofline.shape_key(m): 2e11 for m in mms if m.large}}
    fp32, bf16 = (roofline.limit_seconds(mms, rates, p) for p in ("fp32", "bf16"))
    assert fp32 == pytest.approx(roofline.step_flops(mms) / 1e11)
    loops = sum(m.flops for m in mms if m.loop)
    assert bf16 == pytest.approx((roofline.step_flops(mms) - loops) / 2e11 + loops / 1e11)


def test_measured_matmul_rate_is_a_plausible_flop_rate():
    from tfpar.tools.bench import roofline

    for mm in (roofline.Matmul("x", 64, 32, 48), roofline.Matmul("y", 4, 32, 48, 5, loop=True),
               roofline.Matmul("z", 4, 48, 32, 5, loop=True)):
        rate = roofline.measure_rate(mm, min_seconds=0.01)
        assert 1e6 < rate < 1e14, (mm, rate)


def test_tiny_run_prints_a_verdict_per_target_and_check_sets_the_exit_code(tiny_run):
    code, results, printed, _ = tiny_run
    for name in bench_spec.TARGETS:
        assert f"PASS {name}" in printed or f"FAIL {name}" in printed
    missed = [n for n, t in results["targets"].items() if not t["pass"]]
    assert code == (1 if missed else 0)


def test_unregistered_strategies_are_marked_not_available(monkeypatch):
    from tfpar.parallel import registry as strategies

    # A copy without tower (deleting from the registry itself would re-insert it at the
    # end, changing the order later tests see in its error messages).
    monkeypatch.setattr(strategies, "STRATEGIES",
                        {k: v for k, v in strategies.STRATEGIES.items() if k != "tower"})
    configs = contenders.distribution_configs()
    assert configs["tower2"] == bench_spec.NOT_AVAILABLE
    assert configs["mirrored2"].strategy == "mirrored"


def test_plot_is_a_png(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "b.png"
    report.write_plot(str(path), tiny_run[1])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_one_line_error(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ConfigError, match=r"--plot needs matplotlib.*\.\[bench\]"):
        report.write_plot(str(tmp_path / "b.png"), tiny_run[1])


# ----------------------------------------------------------------- a contender that crashes
class CrashingContender(FakeContender):
    def step(self):
        raise RuntimeError("boom\nsecond line")

    def segment(self, steps):
        self.step()


def test_a_contender_that_crashes_while_timed_stops_the_run_naming_it():
    calls = []
    with pytest.raises(ContenderFailed) as caught:
        measure.interleave([FakeContender("a", 0.1, calls), CrashingContender("b", 0.1, calls)],
                           tiny_spec())
    assert str(caught.value) == "contender b failed: RuntimeError: boom"
    with pytest.raises(ContenderFailed, match="^contender b failed: RuntimeError: boom$"):
        measure.paired_steps(FakeContender("a", 0.1, calls), CrashingContender("b", 0.1, calls), 2)
    with pytest.raises(ContenderFailed, match="^contender b failed"):
        measure.paired_segment_rates(FakeContender("a", 0.1, calls),
                                     CrashingContender("b", 0.1, calls), tiny_spec())


def test_a_remote_contender_whose_segment_raised_fails_naming_it():
    class Server:
        def ask(self, request):
            return {"error": "ValueError: bad shape"}

    with pytest.raises(ContenderFailed, match="^contender tower2 failed: ValueError: bad shape$"):
        remote.RemoteContender("tower2", Server()).segment(3)


def test_a_run_stopped_by_a_crash_exits_1_with_one_line(monkeypatch, capsys):
    def crashed(spec, **_):
        raise ContenderFailed("pipeline2", "RuntimeError: benchmark child process exited (1)")

    monkeypatch.setattr(measure, "run", crashed)
    assert main(["--tiny"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: contender pipeline2 failed: RuntimeError: benchmark child " \
                      "process exited (1)"


def test_a_contender_that_fails_to_build_fails_the_run(monkeypatch, capsys, tmp_path):
    """The other contenders are still measured and reported, then the run exits 1 and
    names every failed one (local and in the child process) on stderr."""
    real_build = contenders.build_tfpar

    def build(setup, name, dist, **options):
        if name == "mirrored1":
            raise RuntimeError("injected crash")
        return real_build(setup, name, dist, **options)

    class NoChild:  # the two-device child, reporting tower2 crashed while it was built
        def __init__(self, spec, names):
            self.status = {n: bench_spec.NOT_AVAILABLE for n in names}
            self.status["tower2"] = "failed: ValueError: child crash"

        def contenders(self):
            return {}

        def close(self):
            pass

    monkeypatch.setattr(contenders, "build_tfpar", build)
    monkeypatch.setattr(measure, "ContenderServer", NoChild)
    # Only what this test is about runs: no variants of the default step, no breakdown
    # (tiny_run measures those).
    for module in (measure, contenders):
        monkeypatch.setattr(module, "variant_configs", lambda spec: {})
    monkeypatch.setattr(measure, "step_breakdown", lambda *args: {})
    monkeypatch.setattr(measure, "breakdown_sentence", lambda *args: {})
    path = tmp_path / "b.json"
    assert main(["--quick", "--tiny", "--json", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "PASS tfpar_vs_keras_baseline" in out or "FAIL tfpar_vs_keras_baseline" in out
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: contender mirrored1 failed: RuntimeError: injected crash",
        "error: contender tower2 failed: ValueError: child crash"]
    results = json.loads(path.read_text())
    assert report.failed_contenders(results) == {
        "mirrored1": "RuntimeError: injected crash", "tower2": "ValueError: child crash"}
    assert isinstance(results["distribution_tokens_per_sec"]["default"], float)


def test_ring_allreduce_and_the_link_fit_invert_each_other():
    from tfpar.tools.bench import scaling

    assert scaling.allreduce_seconds(1, 1e9, 1e9, 1e-3) == 0.0
    # 4 devices: 2 * 3/4 of 8 MB at 1 GB/s, plus 6 hops of 10 us.
    assert scaling.allreduce_seconds(4, 8e6, 1e9, 1e-5) == pytest.approx(0.012 + 6e-5)
    for n in (2, 3):
        sizes = (4096.0, 18.6e6)
        times = [scaling.allreduce_seconds(n, b, 2.5e9, 4e-4) for b in sizes]
        bw, lat = scaling.fit_link(sizes, times, n)
        assert bw == pytest.approx(2.5e9) and lat == pytest.approx(4e-4)


def test_scaling_tables_strong_and_weak():
    from tfpar.tools.bench import scaling

    work = scaling.Workload(flops=1e10, tokens=700, gradient_bytes=1.8e7, layers=2, bptt=35)
    dev = scaling.Device("d", peak_flops=1e13, efficiency=0.5, link_bandwidth=1e10,
                         link_latency=1e-5, launch_latency=1e-5, kernels_per_time_step=2)
    assert scaling.serial_seconds(work, dev) == pytest.approx(1e-5 * 2 * 2 * 2 * 35)
    strong = scaling.scaling_table(work, dev, (1, 2, 4), host_seconds=1e-3)
    weak = scaling.scaling_table(work, dev, (1, 2, 4), host_seconds=1e-3, weak=True)
    assert strong[0]["efficiency"] == weak[0]["efficiency"] == 1.0
    one = strong[0]["step_ms"] / 1e3
    assert one == pytest.approx(1e10 / 5e12 + 2.8e-3 + 1e-3)
    t2 = 1e10 / 2 / 5e12 + 2.8e-3 + 1e-3 + scaling.communication_seconds(2, 1.8e7, 1e10, 1e-5)
    assert strong[1]["step_ms"] / 1e3 == pytest.approx(t2)
    assert strong[1]["speedup"] == pytest.approx(one / t2)
    # Weak scaling keeps each device's work: only the communication is added.
    assert weak[2]["compute_ms"] == strong[0]["compute_ms"]
    assert weak[2]["tokens_per_sec"] == pytest.approx(4 * 700 / (weak[2]["step_ms"] / 1e3))
    assert all(a["efficiency"] >= b["efficiency"] for a, b in zip(weak, weak[1:]))


def test_parameter_count_is_the_models(tmp_path):
    from tfpar.model.lm import build_model
    from tfpar.tools.bench import roofline

    model = build_model(model_config(layers=2, embed_dim=12, hidden_dim=8), 50)
    assert roofline.parameter_count(layers=2, embed_dim=12, hidden_dim=8, vocab_size=50) == \
        sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def test_loopback_workers_flag_errors_name_the_value():
    from tfpar.tools.bench.cli import loopback_counts

    assert loopback_counts("") == () and loopback_counts("2,3") == (2, 3)
    for bad in ("1", "two", "2,x"):
        with pytest.raises(ConfigError, match=f"--loopback-workers '{bad}' must be"):
            loopback_counts(bad)


def test_two_loopback_workers_time_step_compute_and_allreduce():
    """Two multi_worker processes on loopback train the tiny model and report the
    phases the scaling model is checked with."""
    from tfpar.tools.bench import roofline
    from tfpar.tools.bench.workers import measure_loopback

    spec = tiny_spec()
    got = measure_loopback(spec, 2, rounds=1, steps=3)
    assert got["workers"] == 2 and got["batch_size"] == spec.batch_size
    for key in ("step", "compute", "allreduce", "small"):
        assert got[key] > 0, key
    setup = load_setup(spec)
    params = roofline.parameter_count(layers=spec.layers, embed_dim=spec.embed_dim,
                                      hidden_dim=spec.hidden_dim, vocab_size=len(setup.vocab))
    assert got["gradient_bytes"] == 4 * params


def test_corpus_scaling_reports_rss_start_up_and_speed_for_each_factor(tiny_corpus_dir):
    """The tiny corpus's train split repeated twice, trained with a built vocabulary and
    with that run's vocab.txt: every figure is there and plausible, and the repeated
    split is twice the original."""
    from conftest import PINNED

    from tfpar.tools.bench import corpus_scaling

    small = [*PINNED, "--embed-dim", "8", "--hidden-dim", "8", "--batch-size", "8"]
    results = corpus_scaling.run([2], corpus=str(tiny_corpus_dir), steps=3, extra=small)
    (row,) = results["rows"]
    assert row["train_mb"] == pytest.approx(2 * (tiny_corpus_dir / "train.txt").stat().st_size
                                            / 1e6)
    for run in (row["built"], row["vocab_file"]):
        assert run["peak_rss_mb"] > 50  # TensorFlow alone is more
        assert 0 < run["seconds_to_first_step"] < run["wall_seconds"]
        assert run["tokens_per_sec"] > 0 and run["vocab_seconds"] >= 0
    assert row["built"]["vocab_mb_per_sec"] > 0
    assert results["rss_largest_vs_1x"] == 1.0  # one factor: largest and first are the same
    assert set(results["targets"]) == set(corpus_scaling.TARGETS)
    assert "vocab MB/s" in corpus_scaling.format_report(results)


def test_corpus_scaling_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert main(["--corpus-scaling", "0"]) == 2
    assert "--corpus-scaling '0' must be comma-separated integers of at least 1" in \
        capsys.readouterr().err
    # The default corpus: WikiText-2 where tfpar-download puts it, under the working
    # directory (never a folder outside it).
    monkeypatch.chdir(tmp_path)
    assert main(["--corpus-scaling", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --scaling-corpus 'input/wikitext-2' is not a folder; download it with: "
        "tfpar-download wikitext-2 (from a clone: python scripts/download_data.py "
        "wikitext-2), or pass --scaling-corpus DIR")
    assert main(["--corpus-scaling", "1", "--scaling-corpus", "nowhere"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --scaling-corpus 'nowhere' is not a folder; pass a folder holding a "
        "corpus's train, valid and test files")
    (tmp_path / "train.txt").write_text("a b\n")
    assert main(["--corpus-scaling", "1", "--scaling-corpus", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --scaling-corpus '{tmp_path}' has no valid file")
    assert len(err.splitlines()) == 1


def test_zipf_corpus_and_vocabulary_file(tmp_path):
    from tfpar.data.vocab import Vocab
    from tfpar.tools.bench.sampled import write_zipf_corpus

    path = write_zipf_corpus(str(tmp_path), 50, train_tokens=2000, valid_tokens=100, seed=0)
    vocab = Vocab.load(path)
    assert len(vocab) == 50 and vocab.tokens[:4] == ("<pad>", "<unk>", "<eos>", "w0")
    assert vocab.tokens[-1] == "w46"
    words = (tmp_path / "train.txt").read_text().split()
    assert len(words) == 2000 and len((tmp_path / "valid.txt").read_text().split()) == 100
    counts = {w: words.count(w) for w in ("w0", "w1", "w9")}
    assert counts["w0"] > counts["w1"] > counts["w9"] > 0  # Zipf: by rank


def test_sampled_softmax_run_times_both_vocabularies_and_evaluates_with_the_full_softmax(
        tmp_path):
    """--sampled-softmax --tiny: both contenders timed, the ratio checked against its
    target, the sampled model's valid perplexity over every one of its V logits."""
    path = tmp_path / "s.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--sampled-softmax", "--tiny", "--check", "--json", str(path)])
    results = json.loads(path.read_text())
    assert (results["sampled_huge"]["vocab_size"], results["full_10k"]["vocab_size"]) == (600, 60)
    assert results["sampled_huge"]["num_sampled"] == 40
    ratio = results["sampled_huge_vs_full_10k"]
    assert ratio == pytest.approx(results["sampled_huge"]["tokens_per_sec"]
                                  / results["full_10k"]["tokens_per_sec"])
    assert set(results["targets"]) == set(bench_spec.SAMPLED_TARGETS)
    assert code == (0 if results["targets"]["sampled_huge_vs_full_10k"]["pass"] else 1)
    e = results["eval"]
    assert e["softmax"] == "full" and e["eval_logits_width"] == 600
    assert 1 < e["valid_ppl"] < 2 * 600 and e["valid_tokens"] > 200
    assert "full softmax over 600 words" in printed.getvalue()


# ------------------------------------------------ the GPU suite's tokens/s (bench_gpus)
def test_device_scaling_times_mirrored_on_one_device_and_on_two_with_rows_per_device():
    """The GPU suite's measurement, on this host's logical CPUs in place of GPUs: each
    contender trains mirrored over its devices with the same rows per device (weak
    scaling), several steps per call, and its tokens per step are its global batch's
    (stream mode: every position a token), so the larger contender really trained the
    larger batch on its devices. No time is asserted."""
    from bench_gpus import device_scaling, format_line

    setup = load_setup(tiny_spec(rounds=1, steps=4))
    results = device_scaling(setup, {"one": ["/cpu:0"], "two": ["/cpu:0", "/cpu:1"]},
                             rows_per_device=4, steps_per_execution=2)
    assert list(results) == ["one", "two"]
    for r, devices in zip(results.values(), (["/device:CPU:0"],
                                              ["/device:CPU:0", "/device:CPU:1"])):
        assert (r["devices"], r["replicas"], r["batch_size"]) == (devices, len(devices),
                                                                  4 * len(devices))
        tokens_per_step = r["tokens_per_sec"] * r["step_seconds"]
        assert tokens_per_step == pytest.approx(r["batch_size"] * setup.spec.bptt, rel=1e-9)
    line = format_line(results, unit="CPU device")
    one, two = (results[k]["tokens_per_sec"] for k in ("one", "two"))
    assert line == (f"tokens/s (mirrored, 4 rows per CPU device, weak scaling): "
                    f"1 CPU device {one:,.0f}; 2 CPU devices {two:,.0f} ({two / one:.2f}x)")
