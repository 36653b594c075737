"""What ``pip install`` gives: the product (the commands users run and the library under
them), not the test harness, and dependencies whose versions the suite has tested.

The wheel is ``tfpar/`` and nothing else (pyproject: ``packages.find`` includes ``tfpar*``;
tests/test_install.py builds it and lists it), so these checks read the source tree, in
milliseconds: the modules the suite and the docs alone use live in tests/ (fault
injection, the pipeline sweep, the GPU suite's tokens/s; tfpar/docs/architecture.md), and
no module of the package builds a path into a clone (``scripts/train.py``, ``tests/``) or
beside it (``../shared/data``): an installed tfpar has neither.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = pathlib.Path(__file__).resolve().parent.parent
# Moved out of the package (to tests/faults.py, tests/bench_pipeline.py,
# tests/bench_gpus.py): none of them may come back.
HARNESS = ("tfpar/tools/faults.py", "tfpar/tools/bench_pipeline.py", "tfpar/tools/bench/gpus.py")
# Path parts that exist only in a clone (or beside it), as a module would join them.
CLONE_PARTS = {"scripts", "tests", "shared", ".."}


def harness_in(root: pathlib.Path) -> list[str]:
    """The HARNESS modules under ``root`` (a clone), then every place a module of
    ``root/tfpar`` passes a clone's path part to a call or a ``/`` (``os.path.join(REPO,
    "scripts", "train.py")``, ``Path(x) / "shared"``), or holds a string with ``../`` in
    it outside a docstring (a default such as ``"../shared/data"``, or a help text naming
    one)."""
    found = [name for name in HARNESS if (root / name).exists()]
    for path in sorted((root / "tfpar").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        parts = set()  # the strings a call or a / is handed
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                parts |= {id(a) for a in [*node.args, *(k.value for k in node.keywords)]}
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                parts |= {id(node.left), id(node.right)}
        hits = [node for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings
                and ((id(node) in parts and node.value.strip("/") in CLONE_PARTS)
                     or re.search(r"(^|[^.])\.\./", node.value))]
        found += [f"{where}:{n.lineno}: {n.value!r}"
                  for n in sorted(hits, key=lambda n: (n.lineno, n.col_offset))]
    return found


def test_the_package_holds_no_harness_and_no_path_into_a_clone():
    assert harness_in(REPO) == []


def test_the_harness_check_sees_a_module_moved_back_and_a_path_into_a_clone(tmp_path):
    (tmp_path / "tfpar" / "tools").mkdir(parents=True)
    (tmp_path / "tfpar" / "tools" / "faults.py").write_text(
        'import os\nTRAIN = os.path.join(os.path.dirname(__file__), "scripts", "train.py")\n')
    (tmp_path / "tfpar" / "data.py").write_text(
        'import pathlib\nDATA = pathlib.Path("/x") / ".." / "shared"\n'
        'def f(p="../shared/data"):\n    return open(p, encoding="utf-8")\n'
        '"""A docstring may name scripts/train.py and ../shared/data."""\n')
    (tmp_path / "tfpar" / "cli.py").write_text(
        'HELP = "corpus folder (default: ../shared/data/wikitext-2)"\n'
        'NOT = ".../ckpt-12 names a checkpoint; scripts and tests are words"\n')
    assert harness_in(tmp_path) == [
        "tfpar/tools/faults.py", "tfpar/cli.py:1: 'corpus folder (default: "
        "../shared/data/wikitext-2)'", "tfpar/data.py:2: '..'", "tfpar/data.py:2: 'shared'",
        "tfpar/data.py:3: '../shared/data'", "tfpar/tools/faults.py:2: 'scripts'"]


def test_the_wheel_is_the_package_alone_and_keras_and_tensorflow_are_bounded():
    """pyproject packs ``tfpar*`` only (not tests/, scripts/), and bounds the two
    dependencies whose private APIs tfpar uses (tfpar/compat.py) to the minor version the
    suite runs: this environment's versions are inside both ranges."""
    import keras
    import tensorflow as tf
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["tfpar*"]
    requires = {r.name: r for r in map(Requirement, project["project"]["dependencies"])}
    for name, version in (("keras", keras.__version__), ("tensorflow", tf.__version__)):
        bounds = {s.operator for s in requires[name].specifier}
        assert {">=", "<"} <= bounds, (name, str(requires[name].specifier))
        assert requires[name].specifier.contains(version), (name, version)

