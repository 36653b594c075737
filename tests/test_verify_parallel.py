"""scripts/verify_parallel.py and tfpar.tools.verify: parsing, comparison, exit status both ways."""

import importlib.util
import json
import types

import numpy as np
import tensorflow as tf
import pytest

import tfpar.parallel.registry
from tfpar.tools import verify
from tfpar.errors import ConfigError
from tfpar.parallel.parallel_do import ParallelDo
from tfpar.tools.verify import Row, RunResult, Runner, VerifySpec, compare, parse_strategies

# verify's own default step count: enough steps for the automatic clip norm (the median
# of the first steps' gradient norms) to leave some of them clipped and some not, which
# every passing and failing run below asserts (table_rows, assert_clipped_and_unclipped).
STEPS = 10
SMALL = ["--steps", str(STEPS), "--hidden-dim", "8", "--embed-dim", "8"]


def load_script():
    spec = importlib.util.spec_from_file_location(
        "verify_parallel_script", verify.__file__.replace("tfpar/tools/verify.py",
                                                          "scripts/verify_parallel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_strategies():
    assert parse_strategies("default,mirrored:2, tower:3,tower_ring:4,mirrored") == (
        ("default", 1), ("mirrored", 2), ("tower", 3), ("tower_ring", 4))
    assert parse_strategies("tower:2,tower:2") == (("tower", 2),)


@pytest.mark.parametrize("text,match", [
    # Every registered synchronous strategy (the registry's order), then verify's variants.
    ("default,foo:2", r"unknown strategy 'foo' in --strategies; expected one of: default, "
                      r"one_device, mirrored, tower, pipeline, multi_worker, parallel_do, "
                      r"tower_ring \(optionally NAME:REPLICAS\)$"),
    ("mirrored:x", r"replica count 'x' of 'mirrored:x' is not an integer"),
    ("mirrored:0", r"'mirrored:0': mirrored takes >= 1 replica\(s\), got 0"),
    ("default:2", r"'default:2': default takes exactly 1 replica\(s\), got 2"),
    (" , ", r"names no strategy"),
])
def test_parse_strategies_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_strategies(text)


@pytest.mark.parametrize("argv,message", [
    (["--strategies", "default,foo:2"], "error: unknown strategy 'foo'"),
    (["--strategies", "tower:two"], "error: replica count 'two' of 'tower:two'"),
    (["--steps", "0"], "error: --steps must be >= 1, got 0"),
    (["--tolerance", "-1"], "error: --tolerance must be >= 0, got -1.0"),
    (["--tolerance", "nan"], "error: --tolerance must be >= 0, got nan"),
    (["--batch-size", "0"], "error: --batch-size must be >= 1, got 0"),
    (["--eval-tolerance", "-0.5"], "error: --eval-tolerance must be >= 0, got -0.5"),
    (["--clip-norm", "-2"], "error: --clip-norm must be >= 0, got -2.0"),
    (["--lr", "0"], "error: --lr must be > 0, got 0.0"),
])
def test_usage_errors_exit_2_with_one_line(argv, message, capsys):
    assert load_script().main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)


def test_spec_refuses_an_unknown_mode():
    """The command line's choices keep --mode right; a VerifySpec built in code is checked."""
    with pytest.raises(ConfigError, match=r"^unknown mode 'words'; expected one of: sentence, "
                                          r"stream$"):
        VerifySpec(mode="words")


def test_a_failed_multi_worker_job_is_one_line(monkeypatch, capsys):
    """A worker process that fails: ClusterError (exit 2, no traceback), not a missing
    result.npz."""
    monkeypatch.setattr(verify, "run_job", lambda make_plan, command, out: 3)
    setup = types.SimpleNamespace(spec=VerifySpec(), clip_norm=0.5,
                                  initial_weights=[np.zeros(2, np.float32)])
    with pytest.raises(verify.ClusterError, match=r"^the multi_worker:2 verify job failed "
                                                  r"\(status 3\); its log is above$"):
        verify.run_multi_worker(setup, 2)


SLOTS = ([2.0], [0.1], [0.25, -0.5])  # step count, learning rate, a momentum slot


def result(weights, nll=10.0, count=5.0, norms=(1.0, 0.25), slots=SLOTS):
    return RunResult([np.array(w, np.float32) for w in weights], nll, count, list(norms),
                     slots=[np.array(v, np.float32) for v in slots])


def test_compare_applies_both_tolerances():
    spec = VerifySpec(steps=2, tolerance=1e-5, eval_tolerance=1e-6)
    setup = types.SimpleNamespace(clip_norm=0.5)
    ref = result([[1.0, 2.0]])
    same = compare(spec, setup, "tower", 2, result([[1.0, 2.0]]), ref)
    assert same.failures == [] and same.max_abs_param_diff == 0.0
    assert (same.clipped_steps, same.steps) == (1, 2)  # Norm 1.0 > 0.5 is; 0.25 is not.

    near = compare(spec, setup, "tower", 2, result([[1.0, 2.000002]]), ref)
    assert near.failures == [] and 0 < near.max_abs_param_diff <= 1e-5
    strict = compare(VerifySpec(steps=2, tolerance=0.0), setup, "tower", 2,
                     result([[1.0, 2.000002]]), ref)
    assert strict.failures and "> tolerance 0" in strict.failures[0]

    eval_off = compare(spec, setup, "tower", 2, result([[1.0, 2.0]], nll=10.001), ref)
    assert len(eval_off.failures) == 1 and "eval-tolerance 1e-06" in eval_off.failures[0]
    tokens_off = compare(spec, setup, "tower", 2, result([[1.0, 2.0]], count=4.0), ref)
    assert any("eval saw 4 tokens, default 5" in f for f in tokens_off.failures)
    nan = compare(spec, setup, "tower", 2, result([[1.0, float("nan")]]), ref)
    assert nan.failures


@pytest.mark.parametrize("factor", [1.01, 0.99, 2.0])
def test_compare_fails_weights_or_slots_off_by_a_constant_factor(factor):
    """What a gradient off by a constant factor leaves behind on an unclipped step: the
    weights, or (Adam, momentum) only the optimizer's slots, scaled. Either fails."""
    spec = VerifySpec(steps=2)
    setup = types.SimpleNamespace(clip_norm=0.5)
    weights = [[0.5, -1.5], [2.0]]
    ref = result(weights)
    off = compare(spec, setup, "strategy", 2,
                  result([np.array(w) * factor for w in weights]), ref)
    assert off.failures and "max |dtheta|" in off.failures[0]
    assert off.max_abs_param_diff == pytest.approx(2.0 * abs(factor - 1), rel=1e-5)
    slots_off = compare(spec, setup, "strategy", 2, result(
        weights, slots=SLOTS[:2] + (np.array(SLOTS[2]) * factor,)), ref)
    assert slots_off.failures and "max |dtheta|" in slots_off.failures[0]
    assert slots_off.max_abs_param_diff == pytest.approx(0.5 * abs(factor - 1), rel=1e-5)


def test_compare_fails_missing_or_different_optimizer_variables():
    spec = VerifySpec(steps=2)
    setup = types.SimpleNamespace(clip_norm=0.5)
    ref = result([[1.0, 2.0]])
    no_slots = compare(spec, setup, "strategy", 2, result([[1.0, 2.0]], slots=()), ref)
    assert "0 optimizer variables, default 3" in "; ".join(no_slots.failures)
    one_more_step = compare(spec, setup, "strategy", 2,
                            result([[1.0, 2.0]], slots=([3.0],) + SLOTS[1:]), ref)
    assert one_more_step.failures and one_more_step.max_abs_param_diff == 1.0
    short = compare(spec, setup, "strategy", 2, result([[1.0, 2.0]], norms=(1.0,)), ref)
    assert "trained 1 steps, not 2" in "; ".join(short.failures)


@pytest.mark.parametrize("weights,slots,message", [
    ([[1.0, 2.0]], SLOTS, "1 weight tensors, default 2"),
    ([[1.0, 2.0], [3.0], [4.0]], SLOTS, "3 weight tensors, default 2"),
    ([[1.0, 2.0], [3.0, 0.0]], SLOTS, "weight tensor 1 has shape (2,), default (1,)"),
    ([[1.0, 2.0], [3.0]], SLOTS[:2] + ([0.25],), "optimizer variable 2 has shape (1,), "
                                                  "default (2,)"),
    # Without optimizer variables a missing last weight left nothing misaligned behind it.
    ([[1.0, 2.0]], (), "1 weight tensors, default 2"),
])
def test_compare_fails_runs_whose_tensors_do_not_pair_up(weights, slots, message):
    """Tensors are compared in order: one missing, one extra or one of another shape
    fails the row by itself (max |dtheta| is then inf, not a difference of the wrong
    pairs), here with the values of the tensors that are there all equal."""
    spec = VerifySpec(steps=2)
    setup = types.SimpleNamespace(clip_norm=0.5)
    ref = result([[1.0, 2.0], [3.0]], slots=slots if slots == () else SLOTS)
    row = compare(spec, setup, "tower", 2, result(weights, slots=slots), ref)
    assert row.failures == [message]
    assert row.max_abs_param_diff == float("inf")


def test_compare_fails_two_runs_without_weights():
    """Nothing compared is no match: two empty runs do not pass."""
    spec = VerifySpec(steps=2)
    empty = compare(spec, types.SimpleNamespace(clip_norm=0.5), "tower", 2,
                    result([], slots=()), result([], slots=()))
    assert empty.failures == ["default has 0 weight tensors: nothing to compare"]


def test_compare_fails_a_run_that_did_not_train():
    """Gradient norms all 0: the weights matching proves nothing, whichever run it is."""
    spec = VerifySpec(steps=2)
    setup = types.SimpleNamespace(clip_norm=0.5)
    ref = result([[1.0, 2.0]])
    still = compare(spec, setup, "tower", 2, result([[1.0, 2.0]], norms=(0.0, 0.0)), ref)
    assert still.failures == ["tower:2's 2 gradient norms are all 0 (it did not train); a "
                              "run that trains has some norm > 0"]
    ref_still = compare(spec, setup, "tower", 2, result([[1.0, 2.0]]),
                        result([[1.0, 2.0]], norms=(0.0, 0.0)))
    assert ref_still.failures == ["default's 2 gradient norms are all 0 (it did not train); "
                                  "a run that trains has some norm > 0"]
    # One zero norm among others is a step that happened to have no gradient, not a failure.
    assert compare(spec, setup, "tower", 2, result([[1.0, 2.0]], norms=(0.0, 1.0)),
                   ref).failures == []


def test_report_prints_each_new_failure_on_its_line(capsys):
    spec = VerifySpec(steps=2)
    setup = types.SimpleNamespace(clip_norm=0.5, clip_norm_auto=False, spec=spec)
    ref = result([[1.0, 2.0], [3.0]])
    rows = [compare(spec, setup, "tower", 2, result([[1.0, 2.0]]), ref),
            compare(spec, setup, "mirrored", 2, result([[1.0, 2.0], [3.0]], norms=(0, 0)),
                    ref)]
    assert verify.report(setup, rows) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert fails == ["FAIL tower:2: 1 weight tensors, default 2",
                     "FAIL mirrored:2: mirrored:2's 2 gradient norms are all 0 (it did not "
                     "train); a run that trains has some norm > 0"]


def table_rows(out):
    """The report's table: {(strategy, replicas): (clipped, steps, status)}."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 7 and parts[1].isdigit() and "/" in parts[4]:
            clipped, steps = map(int, parts[4].split("/"))
            rows[parts[0], int(parts[1])] = (clipped, steps, parts[6])
    return rows


def assert_clipped_and_unclipped(out, strategies):
    """The report ``out`` has a row for each of ``strategies`` ("name:N,..."), each of
    STEPS steps of which some were clipped by the automatic clip norm and some not."""
    table = table_rows(out)
    assert list(table) == [(n, int(r)) for n, r in (s.split(":") for s in strategies.split(","))]
    assert all(0 < clipped < steps == STEPS for clipped, steps, _ in table.values()), table
    assert "clipping never fired" not in out
    return table


def test_verify_passes_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out" / "rows.json"
    argv = ["--strategies", "mirrored:2,tower:3,parallel_do:3", "--json", str(path)] + SMALL
    assert load_script().main(argv) == 0
    out = capsys.readouterr().out
    assert "all 3 strategies match default" in out
    assert "(auto: the median gradient norm of the first --steps batches)" in out
    # The auto clip norm clips some steps and not others, in every row.
    table = assert_clipped_and_unclipped(out, "mirrored:2,tower:3,parallel_do:3")
    assert all(status == "ok" for _, _, status in table.values()), table
    rows = json.loads(path.read_text())
    assert [(r["strategy"], r["replicas"]) for r in rows] == list(table)
    assert all(set(r) == {"strategy", "replicas", "max_abs_param_diff", "eval_ppl_rel_diff"}
               for r in rows)
    assert all(r["max_abs_param_diff"] <= 1e-5 and r["eval_ppl_rel_diff"] <= 1e-6 for r in rows)


class OffByOnePercent(ParallelDo):
    """parallel_do whose merged gradient (and so its norm) is 1.01 times the right one:
    the same update as the right one on every clipped step."""

    def sum_gradients(self, grads, variables, combine):
        return [1.01 * g for g in super().sum_gradients(grads, variables, combine)]


def test_verify_fails_a_gradient_off_by_one_percent(monkeypatch, tmp_path, capsys):
    """The auto clip norm leaves some steps unclipped, so a gradient off by a constant
    factor moves the weights and the momentum slots differently: exit 1."""
    # Registered, as a new strategy is, and nothing else: verify runs it on N devices.
    monkeypatch.setitem(tfpar.parallel.registry.STRATEGIES, "off_by_1pc",
                        tfpar.parallel.registry.Strategy(
                            lambda dist, model: OffByOnePercent(list(dist.devices)),
                            "devices"))
    path = tmp_path / "rows.json"
    argv = ["--strategies", "parallel_do:2,off_by_1pc:2", "--json", str(path)]
    assert verify.main(argv + SMALL) == 1
    out = capsys.readouterr().out
    table = assert_clipped_and_unclipped(out, "parallel_do:2,off_by_1pc:2")  # Unclipped steps.
    assert table["parallel_do", 2][2] == "ok" and table["off_by_1pc", 2][2] == "FAIL"
    assert "FAIL off_by_1pc:2: max |dtheta|" in out and "FAIL parallel_do" not in out
    rows = json.loads(path.read_text())
    assert rows[1]["strategy"] == "off_by_1pc" and rows[1]["max_abs_param_diff"] > 1e-5


def test_verify_fails_on_a_wrong_strategy_and_warns_when_nothing_is_clipped(
        monkeypatch, tmp_path, capsys):
    """A strategy that drifts (here: default's result nudged by 1e-3) makes it exit 1; a
    clip norm above every gradient norm is reported as leaving clipping untested."""

    def broken(setup, replicas):
        r = verify.run_default(setup, 1)
        r.weights = [w + 1e-3 for w in r.weights]
        return r

    monkeypatch.setitem(verify.RUNNERS, "broken", Runner(broken))
    path = tmp_path / "rows.json"
    argv = ["--strategies", "broken:2", "--clip-norm", "1000", "--json", str(path)]
    assert verify.main(argv + SMALL) == 1
    out = capsys.readouterr().out
    assert "FAIL broken:2: max |dtheta| 0.001 > tolerance 1e-05" in out
    assert "warning: broken:2: clipping never fired" in out
    rows = json.loads(path.read_text())
    assert rows[0]["strategy"] == "broken" and rows[0]["max_abs_param_diff"] > 1e-5


def test_report_exit_status_follows_the_rows(capsys):
    setup = types.SimpleNamespace(clip_norm=0.5, clip_norm_auto=True, spec=VerifySpec())
    good = Row("tower", 2, 1e-7, 1e-8, 1, 2, 0.1, [])
    assert verify.report(setup, [good]) == 0
    assert "all 1 strategies match default" in capsys.readouterr().out
    bad = Row("tower", 3, 1e-3, 1e-8, 1, 2, 0.1, ["max |dtheta| 0.001 > tolerance 1e-05"])
    assert verify.report(setup, [good, bad]) == 1
    assert "FAIL tower:3: max |dtheta| 0.001" in capsys.readouterr().out


def test_help_explains_the_optimizer_and_the_clip_norm():
    text = " ".join(verify.parser().format_help().split())
    assert "SGD" in text and "Adam" in text and "--tolerance" in text
    assert "--momentum" in text and "slots are compared" in text
    assert "median gradient norm" in text and "some steps are clipped and some not" in text


REGULARISED = ["--layers", "2", "--dropout", "0.3", "--embed-dropout", "0.1",
               "--weight-drop", "0.3"]


@pytest.mark.parametrize("mode,strategies,extra", [
    ("sentence", "mirrored:2,pipeline:2", []),
    ("stream", "tower:3", ["--locked-dropout"]),
])
def test_verify_passes_with_every_kind_of_dropout_on(mode, strategies, extra, capsys):
    """Masks keyed by the rows' places in the global batch: N devices (uneven shards,
    micro-batches) give one device's update with dropout on."""
    argv = ["--strategies", strategies, "--mode", mode, *REGULARISED, *extra, *SMALL]
    assert verify.main(argv) == 0
    out = capsys.readouterr().out
    assert f"all {len(strategies.split(','))} strategies match default" in out
    assert_clipped_and_unclipped(out, strategies)


def test_verify_fails_when_replicas_key_masks_by_their_local_rows(monkeypatch, capsys):
    """What the test above guards: a replica drawing masks for rows 0..b-1 of its own
    share (as per-replica generators do) gives a different update."""
    import tfpar.model.lm as lm

    monkeypatch.setattr(lm, "global_rows", lambda batch_rows, rows: tf.range(batch_rows))
    argv = ["--strategies", "mirrored:2", *REGULARISED, *SMALL]
    assert verify.main(argv) == 1
    assert "FAIL mirrored:2: max |dtheta|" in capsys.readouterr().out


def test_verify_passes_with_the_sampled_softmax_and_fails_per_replica_candidates(
        monkeypatch, capsys):
    """``--softmax sampled``: towers match one device because every tower draws the same
    candidates; with TF's stateful sampler (each tower its own draw) they do not."""
    argv = ["--strategies", "tower:2", "--softmax", "sampled", "--num-sampled", "10",
            "--tie-embeddings", *SMALL]
    assert verify.main(argv) == 0
    out = capsys.readouterr().out
    assert "all 1 strategies match default" in out
    assert_clipped_and_unclipped(out, "tower:2")

    from tfpar.objective import output, sampling

    def stateful(key, num_sampled, range_max):
        ids, _, _ = tf.random.log_uniform_candidate_sampler(
            tf.zeros([1, 1], tf.int64), 1, num_sampled, True, range_max)
        return sampling.Candidates(ids, tf.constant(num_sampled, tf.int64), num_sampled,
                                   range_max)

    monkeypatch.setattr(output.sampling, "log_uniform_candidates", stateful)
    assert verify.main(argv) == 1
    # (Its own draws give other gradient norms: not the automatic clip norm's mix.)
    assert "FAIL tower:2: max |dtheta|" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--num-sampled", "10"], "error: --num-sampled 10 only applies to the sampled softmax"),
    (["--softmax", "sampled", "--num-sampled", "500"],
     "error: num-sampled 500 must be smaller than the vocabulary size"),
])
def test_sampled_softmax_usage_errors(argv, message, capsys):
    """One error line, no traceback (the vocabulary check comes after the corpus's log)."""
    assert load_script().main(argv + SMALL) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message), err
    assert [line for line in err if "error" in line.lower()] == err[-1:], err


def test_verify_turns_tf32_off_while_it_runs_and_says_so(monkeypatch, capsys):
    """Issue 42, failure 3: on Ampere and later GPUs TF32 (on by default) rounds float32
    matmuls to 10 bits, far beyond the 1e-5 tolerance. The switch is spied on; the
    reference runner records what it was while training."""
    switched, seen = [], []
    real_switch = tf.config.experimental.enable_tensor_float_32_execution

    def spy(enabled):
        switched.append(enabled)
        real_switch(enabled)

    def recording(setup, replicas):
        seen.append(tf.config.experimental.tensor_float_32_execution_enabled())
        return verify.run_default(setup, replicas)

    monkeypatch.setattr(tf.config.experimental, "enable_tensor_float_32_execution", spy)
    monkeypatch.setitem(verify.RUNNERS, "default", Runner(recording, default_replicas=1,
                                                          max_replicas=1))
    assert tf.config.experimental.tensor_float_32_execution_enabled()  # TensorFlow's default
    assert verify.main(["--strategies", "default", "--steps", "2", "--hidden-dim", "8",
                        "--embed-dim", "8", "--clip-norm", "1"]) == 0
    assert seen == [False, False] and switched == [False, True]  # off, then as it was
    assert ("I tfpar.tools.verify: TF32 off: float32 matmuls compute in float32 on every GPU "
            "(the tolerances assume it; Ampere and later GPUs otherwise round them to 10 bits)"
            in capsys.readouterr().err)
