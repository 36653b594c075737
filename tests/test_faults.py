"""scripts/faults.py: the kill test and the portability matrix, short versions (real
processes, real SIGKILLs), the comparison that decides them, the phase a kill is
reported to have hit, and the one-line usage errors."""

import dataclasses
import importlib.util
import os
import random
import re
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
import faults


def load_script():
    spec = importlib.util.spec_from_file_location(
        "faults_script", os.path.join(REPO, "scripts", "faults.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensors():
    return {"layers/softmax:kernel/.ATTRIBUTES/VARIABLE_VALUE": np.arange(6, dtype=np.float32)
            .reshape(2, 3),
            "moments/softmax_kernel_momentum/.ATTRIBUTES/VARIABLE_VALUE": np.ones(3, np.float32),
            "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE": np.int64(40),
            "carry/rnn_0:0/.ATTRIBUTES/VARIABLE_VALUE": np.full((2, 2), np.nan, np.float32)}


def test_the_comparison_names_the_one_tensor_that_differs_and_by_how_much():
    same = faults.compare_tensors(tensors(), tensors())
    assert same.exact and same.worst == 0.0 and same.compared == 4  # NaN == NaN here

    got = tensors()
    got["layers/softmax:kernel/.ATTRIBUTES/VARIABLE_VALUE"][1, 2] += np.float32(3e-7)
    got["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] = np.int64(39)
    c = faults.compare_tensors(got, tensors())
    assert not c.exact
    assert [d.key for d in c.differing] == ["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE",
                                            "layers/softmax:kernel/.ATTRIBUTES/VARIABLE_VALUE"]
    assert c.differing[0].max_abs == 1.0
    assert c.differing[1].max_abs == pytest.approx(4.7683716e-07)  # float32 spacing at 5
    assert (c.differing[1].count, c.differing[1].size) == (1, 6)
    assert c.describe().startswith("2/4 tensors differ: optimizer/_iterations max|Δ| 1 (1/1); "
                                   "layers/softmax:kernel max|Δ| 4.77e-07 (1/6)")

    fewer = tensors()
    del fewer["carry/rnn_0:0/.ATTRIBUTES/VARIABLE_VALUE"]
    c = faults.compare_tensors(fewer, tensors())
    assert c.missing == ["carry/rnn_0:0/.ATTRIBUTES/VARIABLE_VALUE"] and c.worst == float("inf")
    assert "missing carry/rnn_0:0" in c.describe()


def test_checkpoint_tensors_leave_out_the_bookkeeping(tmp_path):
    import tensorflow as tf

    ckpt = tf.train.Checkpoint(w=tf.Variable([1.0, 2.0]), epoch=tf.Variable(3, dtype=tf.int64))
    ckpt.save(str(tmp_path / "checkpoints" / "ckpt"))
    got = faults.checkpoint_tensors(tmp_path)
    assert sorted(got) == ["epoch/.ATTRIBUTES/VARIABLE_VALUE", "w/.ATTRIBUTES/VARIABLE_VALUE"]
    np.testing.assert_array_equal(got["w/.ATTRIBUTES/VARIABLE_VALUE"], [1.0, 2.0])


def test_a_non_exact_resume_or_a_cell_above_the_tolerance_exits_1(monkeypatch, capsys):
    bad = faults.compare_tensors({"a": np.ones(2)}, {"a": np.zeros(2)})
    round_ = faults.Round("stream", 1, [faults.Kill(3.2, faults.Phase("training", "x"))], bad)
    monkeypatch.setattr(faults, "kill_test", lambda spec: [round_])
    assert load_script().main(["kills", "--kills", "1"]) == 1
    assert "NOT EXACT: 1/1 tensors differ: a max|Δ| 1 (2/2)" in round_.line(1)
    assert faults.kill_summary([round_], ["stream"])[-1] == \
        "kills tried 1, exact 0, not exact 1 (stream 0/1)"

    pair = faults.Pair("sentence", "tower:3", "pipeline", 12,
                       faults.compare_tensors({"a": np.ones(1)}, {"a": np.ones(1) + 2e-5}))
    monkeypatch.setattr(faults, "portability_matrix", lambda spec: [pair])
    assert load_script().main(["matrix"]) == 1
    assert "| tower:3 | — | 2.0e-05 |" in faults.format_matrix([pair], ["tower:3"],
                                                               ["default", "pipeline"])
    assert faults.matrix_summary([pair], 1e-5) == \
        "matrix: 1 pairs, worst max |Δ| 2.0e-05 (sentence tower:3 -> pipeline), 1 above 1e-05"


def fake_process(model_dir, output, seen=(), initial=(), code=None):
    return types.SimpleNamespace(model_dir=str(model_dir), output=output, seen=dict(seen),
                                 initial=set(initial), lines=[(9.5, output)],
                                 proc=types.SimpleNamespace(returncode=code))


def checkpoint_files(model_dir, steps, latest, extra=()):
    d = model_dir / "checkpoints"
    d.mkdir(parents=True)
    for s in steps:
        (d / f"ckpt-{s}.index").write_text("")
    (d / "checkpoint").write_text(f'model_checkpoint_path: "ckpt-{latest}"\n')
    for name in extra:
        (d / name).mkdir()


CORPUS = "I tfpar.training.run: corpus synthetic: 600/60/60 sentences; vocabulary 1526"


@pytest.mark.parametrize("case,want", [
    ("finished", "finished already (last output at 9.5 s)"),
    ("crashed", "exited by itself (status 2)"),
    ("importing", "start-up (imports, devices, corpus)"),
    ("tracing", "tracing + first steps (fresh; steps 1-5)"),
    ("resumed", "tracing + first steps (restored step 20; steps 21-25)"),
    ("temp", "checkpoint write (ckpt-25 being written)"),
    ("state", "checkpoint write (ckpt-25 written, state file not yet updated)"),
    ("training", "training (after ckpt-20; steps 21-25)"),
    ("steps to epoch end", "training (after ckpt-55; steps 56-57)"),
    ("valid eval", "epoch-end evaluation (epoch 1 valid, 1.50 s after ckpt-55)"),
    ("epoch summaries", "epoch-end evaluation (epoch 1 valid done; histograms, gradient "
                        "norms, text samples, ckpt-57 next)"),
    ("final eval", "final evaluation (valid + test)"),
    ("export", "export"),
])
def test_the_phase_a_kill_hit_is_read_from_the_output_and_the_files(case, want, tmp_path):
    schedule = faults.Schedule(max_steps=100, every=5, epoch_ends=(57,))
    model_dir, export_dir = tmp_path / "run", tmp_path / "export"
    pace = {s: s * 0.1 for s in (45, 50, 55)}  # 0.1 s a step
    alive = case not in ("finished", "crashed")
    code = {"finished": 0, "crashed": 2}.get(case)
    output = "" if case == "importing" else CORPUS
    if case == "resumed":
        checkpoint_files(model_dir, [10, 15, 20], 20)
        proc = fake_process(model_dir, output + "\nresumed from x/ckpt-20 (step 20)",
                            {10: 0.0, 15: 0.0, 20: 0.0}, {10, 15, 20})
    elif case in ("training", "temp", "state"):
        checkpoint_files(model_dir, [10, 15, 20] + ([25] if case == "state" else []), 20,
                         ["ckpt-25_temp"] if case == "temp" else [])
        proc = fake_process(model_dir, output, {10: 1.0, 15: 1.5, 20: 2.0})
    elif case in ("steps to epoch end", "valid eval", "epoch summaries"):
        checkpoint_files(model_dir, [45, 50, 55], 55)
        if case == "epoch summaries":
            output += ("\nI tfpar.training.loop: epoch 1/2: train ppl 900.12, valid ppl 813.77, "
                       "12,345 tokens/s, 4.2s")
        proc = fake_process(model_dir, output, pace)
    elif case in ("final eval", "export"):
        checkpoint_files(model_dir, [90, 95, 100], 100)
        proc = fake_process(model_dir, output, {90: 9.0, 95: 9.5, 100: 10.0})
        if case == "export":
            (export_dir / "tfpar_lm" / ".staging-abc").mkdir(parents=True)
    else:
        proc = fake_process(model_dir, output, code=code)
    moment = 7.0 if case == "valid eval" else 5.6
    assert str(faults.infer_phase(proc, str(export_dir), schedule, moment, alive)) == want


def test_a_reference_that_ends_at_an_epoch_end_before_max_steps(tmp_path, monkeypatch):
    """The kill tool's runs: 2 epochs of 38 steps under --max-steps 100, a checkpoint
    every 5 steps. The schedule ends at step 76: a kill after ckpt-76 hit the final
    evaluation (it was read as "training, steps 77-80"), and a redrawn kill follows only
    a checkpoint that 5 steps of training follow (not 35 or 75, which an epoch end
    follows, nor 80-95, which never come: the kill then found the run finished), by up
    to the time 5 steps of training take (0.5 s here; the mean time between
    checkpoints, 0.63 s with the 3 s epoch-end evaluation, reached into it)."""
    class Reference:
        def __init__(self, args, model_dir):  # 0.1 s a step, a 3 s evaluation at 38
            self.seen = {s: s * 0.1 + 3.0 * (s > 38) for s in [*range(5, 76, 5), 38, 76]}

        def wait(self, timeout):
            return 0

        def elapsed(self):
            return 9.0

    monkeypatch.setattr(faults, "TrainProcess", Reference)
    monkeypatch.setattr(faults, "epoch_end_steps", lambda model_dir: [38, 76])
    monkeypatch.setattr(faults, "checkpoint_tensors", lambda model_dir: tensors())
    monkeypatch.setattr(faults, "read_metrics",
                        lambda path: {"steps": 76, "valid_ppl": 9.0, "test_ppl": 8.0})
    ref = faults.run_reference(faults.KillSpec(), "sentence", str(tmp_path))
    assert ref.schedule.max_steps == 76
    assert ref.checkpoint_interval == pytest.approx(0.5)
    assert faults.redraw_anchors(ref, 0) == [5, 10, 15, 20, 25, 30, 40, 45, 50, 55, 60, 65,
                                             70]
    assert faults.redraw_anchors(ref, 60) == [65, 70]
    model_dir = tmp_path / "run"
    checkpoint_files(model_dir, [70, 75, 76], 76)
    proc = fake_process(model_dir, CORPUS, {70: 7.0, 75: 7.5, 76: 7.6})
    assert str(faults.infer_phase(proc, str(tmp_path / "export"), ref.schedule, 8.0, True)) \
        == "final evaluation (valid + test)"


def test_epoch_end_steps_are_read_from_the_runs_metrics_jsonl(tmp_path):
    """A reference run's epoch ends: the steps of its metrics.jsonl lines (TensorBoard's
    eval run has no epoch counter, and a run ending mid-epoch adds a valid point)."""
    assert faults.epoch_end_steps(str(tmp_path)) == []  # no epoch finished
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "step": 38}\n'
                                            '{"epoch": 2, "step": 76}\n')
    assert faults.epoch_end_steps(str(tmp_path)) == [38, 76]


def test_killed_runs_resume_exactly(tmp_path, capsys):
    """One round in stream mode (the carried state must resume too), killed twice: the
    run at a moment drawn from [0, T], then its relaunch; run again, it ends
    bit-identical to the reference, each relaunch having restored the latest checkpoint
    the kill before left (exact includes that check). A kill hit training or a
    checkpoint write (a round that missed is drawn again, its kills aimed after a
    checkpoint), so the final run had a checkpoint to restore."""
    code = load_script().main(["kills", "--kills", "1", "--kills-per-run", "2", "--modes",
                               "stream", "--seed", "2", "--max-steps", "30",
                               "--workdir", str(tmp_path / "w")])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0, "\n".join(out)
    (line,) = [x for x in out if x.startswith("[stream ")]
    assert line.split("->")[1].split("(")[0].strip() == "exact", line
    assert ": training (" in line or ": checkpoint write (" in line, line
    assert "resumed from step " in line, \
        f"the final run had no checkpoint to restore, so none was checked: {line}"
    assert out[-3].startswith("phases hit: ")
    assert out[-2].startswith("rounds with a kill in training or checkpoint write: 1/1 (")
    assert out[-1].startswith("kills tried 1 (SIGKILLs sent ")
    assert out[-1].endswith(", exact 1, not exact 0 (stream 1/1)")
    assert os.listdir(tmp_path / "w") == []  # the runs are cleaned up (no --keep)


def test_a_checkpoint_moved_between_strategies_matches_the_default_run(tmp_path, capsys):
    # Sentence mode here, mirrored -> parallel_do: the move test_portable_checkpoints
    # makes in stream mode only (pipeline -> mirrored -> tower).
    code = load_script().main(["matrix", "--modes", "sentence", "--sources", "mirrored:2",
                               "--targets", "parallel_do:2", "--kill-at-step", "8", "--steps",
                               "20", "--workdir", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert code == 0, out
    # The resume restored the checkpoint the kill left (the tool checks it against the
    # state file: 8, or 4 if the kill came before the state file named ckpt-8).
    resumed = re.search(r"sentence mirrored:2 -> parallel_do:2: resumed from step (\d+), max",
                        out)
    assert resumed and int(resumed.group(1)) in (4, 8), out
    row = [line for line in out.splitlines() if line.startswith("| mirrored:2 |")]
    assert len(row) == 1 and float(row[0].split("|")[2]) <= 1e-5
    assert out.strip().splitlines()[-1].endswith(", 0 above 1e-05")
    assert "matrix: 1 pairs, worst max |Δ| " in out


@pytest.mark.parametrize("restored", [10, None, 5])
def test_a_relaunch_must_restore_the_checkpoint_the_kill_left(restored, tmp_path, monkeypatch):
    """Training is deterministic, so a relaunch that ignored its checkpoint and trained
    from step 0 ends with the reference's tensors and metrics: the kill test and the
    matrix also require its "resumed from" line to name the latest checkpoint the kill
    left (here ckpt-10). The processes are faked: a kill that leaves ckpt-5 and ckpt-10,
    a relaunch that logs ``restored`` (None: no line) and ends with the same tensors."""
    log = (f"I tfpar.training.checkpoints: resumed from {tmp_path}/x/checkpoints/"
           f"ckpt-{restored} (step {restored})" if restored is not None else CORPUS)
    ref = faults.Reference(10.0, tensors(), {"steps": 40, "valid_ppl": 9.0, "test_ppl": 8.0},
                           faults.Schedule(40, 5))

    class FakeProcess:
        def __init__(self, args, model_dir):
            self.model_dir, self.output = model_dir, ""
            self.proc = types.SimpleNamespace(returncode=None)

        def kill_at(self, moment):
            checkpoint_files(Path(self.model_dir), [5, 10], 10)
            return True

        def wait(self, timeout):
            self.output = log
            (Path(self.model_dir + "-export") / "tfpar_lm" / "1").mkdir(parents=True)
            (Path(self.model_dir + "-export") / "tfpar_lm" / "1" / "saved_model.pb").touch()
            return 0

    monkeypatch.setattr(faults, "TrainProcess", FakeProcess)
    monkeypatch.setattr(faults, "infer_phase", lambda *a: faults.Phase("training"))
    monkeypatch.setattr(faults, "checkpoint_tensors", lambda model_dir: tensors())
    monkeypatch.setattr(faults, "read_metrics", lambda path: dict(ref.metrics))
    round_ = faults.kill_round(faults.KillSpec(max_steps=40), "stream", 1, ref,
                               str(tmp_path), random.Random(0))
    assert round_.comparison.exact and not round_.metrics_diff  # what the tensors show
    assert round_.resumed_from == restored

    source = tmp_path / "source"
    checkpoint_files(source, [5, 10], 10)  # the checkpoints a killed source run left
    monkeypatch.setattr(faults, "run_to_end", lambda *a, **k: log)
    pair = faults.move_checkpoint("corpus", str(tmp_path), "stream", str(source), "mirrored:2",
                                  "tower:3", faults.MatrixSpec(), tensors())
    assert pair.resumed_from == restored
    if restored == 10:
        assert round_.exact and "-> exact (resumed from step 10; " in round_.line(1)
        assert not pair.error and pair.worst == 0.0
        return
    want = ("started from step 0, ignoring the checkpoint of step 10" if restored is None
            else "resumed from step 5, not the latest checkpoint (step 10)")
    assert not round_.exact and f"-> NOT EXACT: {want} (" in round_.line(1)
    assert pair.error == want and pair.worst == float("inf")


@pytest.mark.parametrize("redraws", [0, 2])
def test_a_round_whose_kills_miss_training_is_drawn_again_then_fails(redraws, tmp_path,
                                                                     monkeypatch, capsys):
    """Faked processes whose kills all land in the final evaluation: with --redraws 2 the
    round is drawn twice more (killed after one of the run's own checkpoints, by up to
    the reference's time between two, abandoned before a resume), then reported as missed and the tool exits 1; with --redraws 0 a draw is
    kept whatever it hit. A kill that hits training ends the redraws (the second case)."""
    ref = faults.Reference(10.0, tensors(), {"steps": 40, "valid_ppl": 9.0, "test_ppl": 8.0},
                           faults.Schedule(40, 5), 0.5)
    moments, resumes, delays = [], [], []

    class FakeProcess:
        def __init__(self, args, model_dir):
            self.model_dir, self.output = model_dir, ""
            self.proc = types.SimpleNamespace(returncode=None)

        def kill_at(self, moment):
            moments.append(moment)
            checkpoint_files(Path(self.model_dir), [5, 10], 10)
            return True

        def kill_after_checkpoint(self, step, delay, timeout):
            delays.append((step, delay))
            return self.kill_at(1.0 + delay), 1.0 + delay

        def wait(self, timeout):
            resumes.append(self.model_dir)
            self.output = (f"I tfpar.training.checkpoints: resumed from x/ckpt-10 (step 10)")
            (Path(self.model_dir + "-export") / "tfpar_lm" / "1").mkdir(parents=True)
            (Path(self.model_dir + "-export") / "tfpar_lm" / "1" / "saved_model.pb").touch()
            return 0

    monkeypatch.setattr(faults, "TrainProcess", FakeProcess)
    monkeypatch.setattr(faults, "infer_phase",
                        lambda *a: faults.Phase("final evaluation", "valid + test"))
    monkeypatch.setattr(faults, "checkpoint_tensors", lambda model_dir: tensors())
    monkeypatch.setattr(faults, "read_metrics", lambda path: dict(ref.metrics))
    monkeypatch.setattr(faults, "run_reference", lambda *a, **k: ref)
    spec = faults.KillSpec(kills=1, modes=("stream",), max_steps=40, redraws=redraws,
                           workdir=str(tmp_path / "w"))
    (round_,) = faults.kill_test(spec)
    out = capsys.readouterr().out
    assert len(moments) == redraws + 1 and len(resumes) == 1  # only the last draw resumed
    # Redraws kill after a checkpoint of the run's own, 5..35, by up to the interval.
    assert len(delays) == redraws and all(s in range(5, 40, 5) and 0.0 <= d <= 0.5
                                          for s, d in delays)
    assert round_.exact and round_.redrawn == redraws and not round_.aimed
    assert round_.passed == (redraws == 0)
    if redraws:
        assert "-> exact; MISSED: no kill hit training or checkpoint write (redrawn 2x; " in out
        assert "rounds with a kill in training or checkpoint write: 0/1 (2 redraw(s))" in out

    # A redraw that hits training is kept and passes.
    phases = iter([faults.Phase("export"), faults.Phase("training", "after ckpt-5")])
    monkeypatch.setattr(faults, "infer_phase", lambda *a: next(phases))
    moments.clear()
    resumes.clear()
    spec = dataclasses.replace(spec, redraws=3, workdir=str(tmp_path / "w2"))
    (round_,) = faults.kill_test(spec)
    assert len(moments) == 2 and len(resumes) == 1 and round_.passed and round_.redrawn == 1
    assert "killed at" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["kills", "--kills", "0"], "error: --kills must be >= 1, got 0"),
    (["kills", "--kills-per-run", "0"], "error: --kills-per-run must be >= 1, got 0"),
    (["kills", "--redraws", "-1"], "error: --redraws must be >= 0, got -1"),
    (["kills", "--modes", "sentence,foo"], "error: unknown mode 'foo' in --modes; expected "
                                           "one of: sentence, stream"),
    (["kills", "--modes", " , "], "error: --modes ' , ' names nothing"),
    (["kills", "--modes", "stream,stream"], "error: --modes 'stream,stream' names an entry "
                                            "twice"),
    (["kills", "--strategy", "multi_worker"], "error: --strategy multi_worker needs TF_CONFIG"),
    (["kills", "--strategy", "foo"], "error: unknown --strategy 'foo'; expected one of: "
                                     "default, one_device"),
    (["kills", "--cpu-devices", "-1"], "error: --cpu-devices must be >= 0, got -1"),
    (["kills", "--checkpoint-every", "0"], "error: --checkpoint-every must be >= 1, got 0"),
    (["kills", "--max-steps", "5"], "error: --max-steps must be > --checkpoint-every (5), "
                                    "got 5"),
    (["matrix", "--sources", "tower:x"], "error: device count 'x' of 'tower:x' is not an "
                                         "integer; e.g. tower:2"),
    (["matrix", "--targets", "foo"], "error: unknown strategy 'foo' in 'foo'"),
    (["matrix", "--targets", "multi_worker:2"], "error: multi_worker needs TF_CONFIG and one "
                                                "process per task"),
    (["matrix", "--sources", "default:2"], "error: 'default:2': default runs on one device"),
    (["matrix", "--sources", "mirrored:0"], "error: 'mirrored:0': the device count must be "
                                            ">= 1, got 0"),
    (["matrix", "--checkpoint-every", "0"], "error: --checkpoint-every must be >= 1, got 0"),
    (["matrix", "--kill-at-step", "10"], "error: --kill-at-step 10 must be a positive "
                                         "multiple of --checkpoint-every 4"),
    (["matrix", "--steps", "12"], "error: --steps must be > --kill-at-step (12), got 12"),
    (["matrix", "--tolerance", "-1"], "error: --tolerance must be >= 0, got -1.0"),
    (["matrix", "--sources", "default", "--targets", "default"],
     "error: --sources and --targets leave no pair"),
])
def test_usage_errors_exit_2_with_one_line(argv, message, capsys):
    assert load_script().main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


def test_the_fault_tests_take_their_strategies_from_the_registry():
    """A strategy registered in tfpar.parallel.registry, and nowhere else, is one the
    fault tests run in one process, with its devices' default count (a fresh process:
    the lists are read when the module is imported)."""
    import subprocess
    import sys

    code = ("from tfpar.parallel import registry\n"
            "registry.STRATEGIES['fake'] = registry.Strategy(None, 'devices', "
            "min_cpu_devices=3)\n"
            "import faults\n"
            "print(faults.strategy_flags('fake'), faults.strategy_flags('fake:2'), "
            "'fake' in faults.IN_PROCESS, faults.CLUSTER)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [REPO, os.path.join(REPO, "tests")])}).stdout
    assert out.strip() == ("['--strategy', 'fake', '--cpu-devices', '3'] "
                           "['--strategy', 'fake', '--cpu-devices', '2'] True "
                           "('multi_worker', 'parameter_server')")


@pytest.mark.parametrize("kind", ["file", "not empty"])
def test_a_workdir_that_is_a_file_or_not_empty_is_refused(kind, tmp_path, capsys):
    path = tmp_path / "w"
    if kind == "file":
        path.write_text("x")
    else:
        path.mkdir()
        (path / "old").write_text("x")
    assert load_script().main(["kills", "--workdir", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --workdir '{path}' is {'a file' if kind == 'file' else 'not empty'}"
                   "; give a new or empty folder"]


def test_the_selections_perplexity_differs_relatively():
    """A float32 valid perplexity near 700 one ulp apart (6.1e-5) with weights 1e-7 apart:
    max |Δ| is the weights' 1e-7, not the perplexity's ulp, which is above the matrix's
    1e-5 tolerance; the tensors still are not exact (a resume must match bit for bit)."""
    ppl = np.float32(700.0)
    key = "selection/best_valid_ppl/.ATTRIBUTES/VARIABLE_VALUE"
    want = {key: np.array(ppl), "layers/w": np.zeros(3, np.float32)}
    got = {key: np.array(np.nextafter(ppl, np.float32(1000))),
           "layers/w": np.full(3, 1e-7, np.float32)}
    c = faults.compare_tensors(got, want)
    assert not c.exact
    assert c.worst == pytest.approx(1e-7, rel=1e-3)
