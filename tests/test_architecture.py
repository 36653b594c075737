"""The package's dependencies point one way, and the step is written once.

Layers, top to bottom (a module may import its own layer and the ones below, never one
above; no import cycles at all, function-local imports included)::

    api        make_config, train (the Python API; ``tfpar`` itself re-exports it lazily)
    tools      cli, verify, bench, launcher, the installed commands
    training   state, schedule, loop (+hooks), checkpoints, summaries, run
    parallel   strategy plug-ins, devices, cluster        serving   export, sample
    data       corpora, vocab, pipeline                   model     objective
    base       config, errors, files, compat (the private TF/Keras/argparse APIs)
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfpar"
LAYERS = {
    "tfpar": 0, "tfpar.config": 0, "tfpar.errors": 0, "tfpar.files": 0, "tfpar.compat": 0,
    "tfpar.data": 1, "tfpar.model": 1, "tfpar.objective": 1,
    "tfpar.parallel": 2, "tfpar.serving": 2,
    "tfpar.training": 3,
    "tfpar.tools": 4,
    "tfpar.api": 5,
}
# The package's __init__ hands out the API on first use (``tfpar.train``): the one import
# of a higher layer allowed, so ``import tfpar`` stays free of TensorFlow.
LAZY_EXPORTS = {("tfpar", "tfpar.api")}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """tfpar modules ``path`` imports, at module level or inside functions.

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module (a
    sub-module import), else as importing ``pkg``.
    """
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "tfpar"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package the module sits in
                package = module_name(path) if path.name == "__init__.py" else \
                    module_name(path).rpartition(".")[0]
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.split(".")[0] != "tfpar":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return out & modules


def layer_of(module: str) -> int:
    while module not in LAYERS:
        module = module.rpartition(".")[0]
    return LAYERS[module]


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_has_a_layer():
    for name in all_modules():
        assert layer_of(name) >= 0


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_imports_point_down_the_layers():
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in sorted(import_graph().items()) for b in sorted(targets)
              if layer_of(b) > layer_of(a) and (a, b) not in LAZY_EXPORTS]
    assert upward == []


def test_the_checks_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("tfpar.tools.verify") > layer_of("tfpar.parallel.tower")


def test_function_local_imports_are_seen(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from tfpar.tools import cli\n    import tfpar.errors\n")
    assert imports_of(source, {"tfpar.tools.cli", "tfpar.errors", "tfpar.tools"}) == {
        "tfpar.tools.cli", "tfpar.errors"}


@pytest.mark.parametrize("words", [("clip_factor", "is_finite")])
def test_the_update_is_written_once(words):
    """Only the one step module computes the clip factor and the finite guard."""
    owners = [name for name, path in all_modules().items()
              if all(w in path.read_text(encoding="utf-8") for w in words)]
    assert owners == ["tfpar.objective.step"]


def calls_of(name: str, modules: dict | None = None) -> list[str]:
    """The modules (default: the whole package) whose code, docstrings and comments
    aside, calls ``name(...)`` or ``<x>.name(...)``, once per call."""
    found = []
    for module, path in sorted((all_modules() if modules is None else modules).items()):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and name in (getattr(node.func, "attr", None),
                                                        getattr(node.func, "id", None)):
                found.append(module)
    return found


def synchronous_path() -> dict:
    """The step and the synchronous plug-ins (the parameter server's asynchronous update
    and verify's independent reference aside)."""
    return {name: path for name, path in all_modules().items()
            if name == "tfpar.objective.step" or (name.startswith("tfpar.parallel.")
            and not name.startswith(("tfpar.parallel.cluster", "tfpar.parallel.parameter_server")))}


def test_the_optimizer_is_called_once_in_the_package():
    """Every synchronous plug-in places the update (``run_update``); the one
    ``apply_gradients`` call is the step's (the parameter server's asynchronous update
    assigns its own, Keras 3 having no parameter-server optimizer)."""
    assert calls_of("apply_gradients") == ["tfpar.objective.step"]


@pytest.mark.parametrize("name", ["token_count", "add_gradients"])
def test_the_count_and_the_gradient_sum_are_the_steps(name):
    """The global token count and the sum of the replicas' gradients are computed once,
    in the step (``aggregate``; ``combine_gradients``' ``add_gradients``): a plug-in
    replicates the count's function and runs the sum where it sums, and calls neither
    itself; nothing in the synchronous path all-reduces in a replica context (the
    plug-in sums the step's values)."""
    assert "tfpar.parallel.distribute" in synchronous_path()
    assert calls_of(name, synchronous_path()) == ["tfpar.objective.step"]
    assert calls_of("all_reduce", synchronous_path()) == []


def definitions_of(name: str) -> list[str]:
    """The modules that define a function or class ``name`` (at any depth)."""
    return sorted(module for module, path in all_modules().items()
                  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                  if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name)


def test_rows_are_cut_in_one_module():
    """A global batch and its state are cut into replica shares by ``tfpar.parallel.rows``
    alone (the plug-ins and verify's reference call it); the data, model, objective and
    training layers cut no rows."""
    for name in ("shard_bounds", "shard_rows", "state_rows", "per_replica"):
        assert definitions_of(name) == ["tfpar.parallel.rows"], name
        below = [m for m in calls_of(name) if m.startswith(
            ("tfpar.data", "tfpar.model", "tfpar.objective", "tfpar.training"))]
        assert below == [], name


def test_the_runner_runs_and_the_step_steps():
    """The host loop over batches and the in-graph multi-step loop are the training
    layer's runner; the step module reads no iterator, and a plug-in does not build
    steps (the step is built around a plug-in, not by it)."""
    for name in ("run_steps", "make_train_steps", "CallOutput"):
        assert definitions_of(name) == ["tfpar.training.runner"], name
    objective = {n: p for n, p in all_modules().items() if n.startswith("tfpar.objective")}
    assert calls_of("get_next_as_optional", objective) == []
    for name in ("make_train_step", "make_eval_step"):
        assert definitions_of(name) == ["tfpar.objective.step"] + (
            ["tfpar.parallel.parameter_server"] if name == "make_eval_step" else []), name


def test_the_step_is_handed_its_loss():
    """The loss (the full or the sampled softmax) is an object handed to the step
    (``tfpar.objective.output``): the step and the synchronous plug-ins read no softmax
    setting from the model's config."""
    for name, path in synchronous_path().items():
        text = path.read_text(encoding="utf-8")
        for word in ("config.softmax", "fused_softmax", "softmax_block_sizes", "num_sampled"):
            assert word not in text, (name, word)


def test_the_call_finder_sees_a_second_call(tmp_path, monkeypatch):
    extra = tmp_path / "extra.py"
    extra.write_text("def f(o, g, b):\n    o.apply_gradients(g)\n    return token_count(b)\n")
    monkeypatch.setitem(globals(), "all_modules",
                        lambda: {"tfpar.objective.step": PACKAGE / "objective" / "step.py",
                                 "tfpar.parallel.extra": extra})
    assert calls_of("apply_gradients") == ["tfpar.objective.step", "tfpar.parallel.extra"]
    assert calls_of("token_count", synchronous_path()) == ["tfpar.objective.step",
                                                           "tfpar.parallel.extra"]


def test_the_registry_has_every_strategy_and_refuses_async_for_a_sync_step():
    from tfpar.config import DistConfig
    from tfpar.errors import ConfigError
    from tfpar.parallel.registry import ASYNCHRONOUS, STRATEGIES, build_strategy

    assert set(STRATEGIES) == {"default", "one_device", "mirrored", "tower", "pipeline",
                               "multi_worker", "parallel_do"}
    assert set(ASYNCHRONOUS) == {"parameter_server"}
    with pytest.raises(ConfigError, match=r"^parameter_server trains asynchronously: it has "
                                          r"no synchronous step; use one of: default, "):
        build_strategy(DistConfig(strategy="parameter_server"))
    with pytest.raises(ConfigError, match=r"unknown strategy 'nope'; expected one of: .*"
                                          r"parallel_do, parameter_server$"):
        build_strategy(DistConfig(strategy="nope"))


def strategy_name_tests(path: pathlib.Path, names) -> list[tuple[int, str]]:
    """``(line, name)`` of every comparison in ``path`` with a strategy's name as a
    literal (``== "parameter_server"``, ``in ("default", "one_device")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            found += [(node.lineno, i.value) for i in items
                      if isinstance(i, ast.Constant) and i.value in names]
    return found


# Outside the plug-ins (a plug-in and its cluster tools know their own name), what a
# strategy does is asked of the registry (its traits) or of the plug-in, never read off its
# name. The benchmark's contenders are named like strategies ("default", "mirrored2").
KNOWS_STRATEGY_NAMES = ("tfpar.parallel", "tfpar.tools.bench", "tfpar.tools.bench_pipeline")


def test_no_strategy_is_told_by_its_name_outside_the_plug_ins():
    from tfpar.parallel.registry import names

    found = {name: strategy_name_tests(path, set(names()))
             for name, path in all_modules().items()
             if not name.startswith(KNOWS_STRATEGY_NAMES)}
    assert not {name: hits for name, hits in found.items() if hits}


def test_the_name_test_check_sees_equality_and_membership(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("if s == 'parameter_server':\n    pass\n"
                      "ok = s in ('default', 'one_device') or s != 'tower_ring'\n")
    assert strategy_name_tests(source, {"parameter_server", "default", "one_device"}) == [
        (1, "parameter_server"), (3, "default"), (3, "one_device")]


# ------------------------------------------------------------------ graph functions
def tf_functions_without_autograph_off(path: pathlib.Path) -> list[int]:
    """Lines of ``tf.function`` decorators and calls in ``path`` that do not pass
    ``autograph=False``."""
    def is_tf_function(node):
        return (isinstance(node, ast.Attribute) and node.attr == "function"
                and isinstance(node.value, ast.Name) and node.value.id == "tf")

    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bad += [d.lineno for d in node.decorator_list if is_tf_function(d)]
        elif isinstance(node, ast.Call) and is_tf_function(node.func):
            off = [k for k in node.keywords if k.arg == "autograph"
                   and isinstance(k.value, ast.Constant) and k.value.value is False]
            if not off:
                bad.append(node.lineno)
    return bad


def test_every_graph_function_is_traced_without_autograph():
    """The package writes its graph control flow itself (tf.while_loop, tf.cond), so no
    ``tf.function`` of it has autograph rewrite the Python it calls: the rewrite of every
    function a step reaches took about a third of a small run's time (a 6-step run on
    the tiny corpus: 21-23 s with it, 13.8 s without), and a Python ``if`` on a tensor
    fails at trace time instead of becoming a silent ``tf.cond``."""
    bad = {module_name(p): lines for p in sorted(PACKAGE.rglob("*.py"))
           if (lines := tf_functions_without_autograph_off(p))}
    assert bad == {}


def test_the_autograph_check_sees_a_bare_decorator_and_a_call(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import tensorflow as tf\n\n@tf.function\ndef f():\n    pass\n\n"
                      "g = tf.function(f, jit_compile=True)\n"
                      "h = tf.function(f, autograph=False)\n")
    assert tf_functions_without_autograph_off(source) == [3, 7]


# ------------------------------------------------------------------- private APIs
# Private TensorFlow / Keras / argparse names are used in tfpar.compat alone (each with why
# and the versions checked, and a behaviour test in tests/test_compat.py). Elsewhere an
# object's own private attributes (``self._x``, ``cls._x``, ``super()._x``) are fine, and so
# are these, tfpar's own private names read by a close collaborator, and ``os._exit``
# (a documented public function despite its underscore):
OWN_PRIVATE = {
    ("tfpar.tools.bench.sampled", "contender._outputs"),  # a bench Contender's steps
    ("tfpar.tools.bench.measure", "data._examples"),  # InputData's line -> example map
    ("tfpar.tools.parsing", "sub._option_strings"),  # a sub-command's tfpar Parser
}
PUBLIC_DESPITE_UNDERSCORE = {"os._exit"}
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.core", "tensorflow.compiler")
# The Trackable saving protocol and the optimizer's sum: defining one of these overrides a
# foreign class's private behaviour.
FOREIGN_PROTOCOL = {"_serialize_to_tensors", "_restore_from_tensors", "_trackable_children",
                    "_gather_saveables_for_checkpoint", "_all_reduce_sum_gradients"}
FRAME_ATTRIBUTES = {"f_back", "f_locals", "f_globals", "tb_frame"}
STACK_CALLS = {"inspect.currentframe", "inspect.stack", "inspect.getouterframes",
               "inspect.getframeinfo"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: pathlib.Path, module: str = "") -> list[str]:
    """``"<line>: <what>"`` for every private API ``path``'s code (docstrings aside) uses:
    a private attribute of another object, ``tf.__internal__``, a private module
    (``keras.src``) imported or named in a string, a private name given to
    ``getattr``/``hasattr``/``setattr``/``delattr``, a stack walk, or a definition of a
    foreign private protocol method."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute):
            text = ast.unparse(node)
            own = (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) or (
                isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "super")
            if node.attr == "__internal__" or node.attr in FRAME_ATTRIBUTES or (
                    _is_private(node.attr) and not own
                    and (module, text) not in OWN_PRIVATE
                    and text not in PUBLIC_DESPITE_UNDERSCORE):
                what = text
        elif isinstance(node, ast.Import):
            what = ", ".join(a.name for a in node.names
                             if a.name.startswith(PRIVATE_MODULES)
                             or any(_is_private(p) for p in a.name.split(".")))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n.startswith(PRIVATE_MODULES) or any(_is_private(p) for p in n.split("."))
                   for n in names):
                what = f"from {node.module} import ..."
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings and any(m in node.value for m in PRIVATE_MODULES):
            what = repr(node.value)
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in STACK_CALLS:
                what = f"{name}()"
            elif name in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and _is_private(node.args[1].value):
                what = f"{name}(..., {node.args[1].value!r})"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name in FOREIGN_PROTOCOL:
            what = f"def {node.name}"
        if what:
            found.append(f"{node.lineno}: {what}")
    return sorted(found, key=lambda s: (int(s.split(":")[0]), s))


def inherited_private_reads(paths) -> list[str]:
    """``self._x`` / ``cls._x`` reads whose ``_x`` no tfpar code defines (assigns on
    ``self``/``cls``, or names in a ``def``, ``class`` or assignment): a foreign base
    class's private attribute read through inheritance."""
    used, defined = {}, set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("self", "cls") and _is_private(node.attr):
                if isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                else:
                    used.setdefault(node.attr, f"{path.name}:{node.lineno}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    return sorted(f"{where}: self.{name}" for name, where in used.items()
                  if name not in defined)


def test_private_apis_are_used_in_compat_alone():
    """No module but ``tfpar.compat`` reaches into TensorFlow's, Keras' or argparse's
    private names (the design's rule: one module, each use explained and tested)."""
    uses = {name: found for name, path in all_modules().items()
            if name != "tfpar.compat" and (found := private_uses(path, name))}
    assert uses == {}
    assert private_uses(PACKAGE / "compat.py")  # the fence holds what it fences
    outside = [p for name, p in all_modules().items() if name != "tfpar.compat"]
    assert inherited_private_reads(outside) == []


def test_the_private_api_check_sees_each_kind_of_use(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        '"""A docstring may name keras.src and opt._x."""\n'
        "import importlib, inspect, os\n"
        "from keras.src import backend\n"
        "import tensorflow.python.eager\n"
        "class C(Base):\n"
        "    def _serialize_to_tensors(self):\n"
        "        return self._mine, super()._theirs, os._exit\n"
        "def f(opt, spec):\n"
        "    opt._all_reduce_sum_gradients = None\n"
        "    spec._with_tensor_ranks_only()\n"
        "    getattr(opt, '_learning_rate', None)\n"
        "    importlib.import_module('keras.src.backend.tensorflow.rnn')\n"
        "    frame = inspect.currentframe().f_back\n"
        "    return tf.__internal__.distribute.ShardedVariable, contender._outputs\n")
    assert private_uses(source) == [
        "3: from keras.src import ...", "4: tensorflow.python.eager",
        "6: def _serialize_to_tensors", "9: opt._all_reduce_sum_gradients",
        "10: spec._with_tensor_ranks_only", "11: getattr(..., '_learning_rate')",
        "12: 'keras.src.backend.tensorflow.rnn'", "13: inspect.currentframe()",
        "13: inspect.currentframe().f_back", "14: contender._outputs",
        "14: tf.__internal__"]
    assert "14: contender._outputs" not in private_uses(source, "tfpar.tools.bench.sampled")
    assert inherited_private_reads([source]) == ["m.py:7: self._mine"]
