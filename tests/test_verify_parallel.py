"""scripts/verify_parallel.py and tfpar.tools.verify: parsing, comparison, exit status both ways."""

import importlib.util
import json
import types

import numpy as np
import pytest

from tfpar.tools import verify
from tfpar.errors import ConfigError
from tfpar.tools.verify import RunResult, Runner, VerifySpec, compare, parse_strategies

SMALL = ["--steps", "2", "--hidden-dim", "8", "--embed-dim", "8"]


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
    ("default,foo:2", r"unknown strategy 'foo' in --strategies; expected one of: default, "
                      r"mirrored, tower"),
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
])
def test_usage_errors_exit_2_with_one_line(argv, message, capsys):
    assert load_script().main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)


def result(weights, nll=10.0, count=5.0, norms=(1.0, 1.0)):
    return RunResult([np.array(w, np.float32) for w in weights], nll, count, list(norms))


def test_compare_applies_both_tolerances():
    spec = VerifySpec(steps=2, tolerance=1e-5, eval_tolerance=1e-6)
    setup = types.SimpleNamespace(clip_norm=0.5)
    ref = result([[1.0, 2.0]])
    same = compare(spec, setup, "tower", 2, result([[1.0, 2.0]]), ref)
    assert same.failures == [] and same.max_abs_param_diff == 0.0 and same.clipped_steps == 2

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


def test_verify_passes_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out" / "rows.json"
    argv = ["--strategies", "default,mirrored:2,tower:3", "--json", str(path)] + SMALL
    assert load_script().main(argv) == 0
    out = capsys.readouterr().out
    assert "all 3 strategies match default" in out
    assert "(auto: half the first batch's gradient norm)" in out
    assert out.count(" 2/2 ") == 3  # Clipping fired on both steps of every strategy.
    rows = json.loads(path.read_text())
    assert [(r["strategy"], r["replicas"]) for r in rows] == [
        ("default", 1), ("mirrored", 2), ("tower", 3)]
    assert all(set(r) == {"strategy", "replicas", "max_abs_param_diff", "eval_ppl_rel_diff"}
               for r in rows)
    assert rows[0]["max_abs_param_diff"] == 0.0
    assert all(r["max_abs_param_diff"] <= 1e-5 and r["eval_ppl_rel_diff"] <= 1e-6 for r in rows)


def test_verify_fails_on_a_wrong_strategy(monkeypatch, tmp_path, capsys):
    """A strategy that drifts (here: default's result nudged by 1e-3) makes it exit 1."""

    def broken(setup, replicas):
        r = verify.run_default(setup, 1)
        r.weights = [w + 1e-3 for w in r.weights]
        return r

    monkeypatch.setitem(verify.RUNNERS, "broken", Runner(broken))
    path = tmp_path / "rows.json"
    argv = ["--strategies", "default,broken:2", "--clip-norm", "1000", "--json", str(path)]
    assert verify.main(argv + SMALL) == 1
    out = capsys.readouterr().out
    assert "FAIL broken:2: max |dtheta| 0.001 > tolerance 1e-05" in out
    assert "warning: default:1: clipping never fired" in out
    rows = json.loads(path.read_text())
    assert rows[1]["strategy"] == "broken" and rows[1]["max_abs_param_diff"] > 1e-5


def test_help_explains_sgd():
    text = verify.parser().format_help()
    assert "SGD" in text and "Adam" in text and "--tolerance" in text
