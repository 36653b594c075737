"""The wheel test: ``pip install`` gives working commands without the repository.

The wheel is built from a copy of the package files (nothing is written into the clone)
with this environment's setuptools (no build isolation: nothing is downloaded), and
installed into a fresh venv under tmp_path. That venv sees this environment's
site-packages (TensorFlow, numpy) through a ``.pth`` line, which does not run the
``__editable__`` finder an editable install of tfpar puts there: ``import tfpar`` in the
venv must find the installed copy, and is checked to. Every command then runs from a
folder outside the clone: ``--help`` of each, ``tfpar-train`` on the generated corpus with
an export, ``tfpar-generate`` on that export, and a two-worker ``tfpar-launch`` job, whose
tasks start the training through the package (``python -m tfpar.tools.train``).
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import PINNED, REPO
from tfpar.tools.commands import COMMANDS

pytestmark = pytest.mark.wheel

# The smallest model and run the end-to-end tests use (seconds per process).
TINY = [*PINNED, "--synthetic-sentences", "200,20,20", "--embed-dim", "8", "--hidden-dim", "8",
        "--batch-size", "8", "--eval-batch-size", "20", "--no-progress"]
# A native (C++) TensorFlow log line or absl's preamble: the console filter hides them.
NATIVE = re.compile(r"^([IW]\d{4} [\d:.]+ +\d+ \S+:\d+\] |WARNING: All log messages before "
                    r"absl::InitializeLog)", re.M)


def build_wheel(tmp_path) -> str:
    """The wheel of a copy of the package files; its path."""
    import setuptools

    major = int(setuptools.__version__.split(".")[0])
    assert major >= 77, (f"setuptools {setuptools.__version__} cannot build this pyproject.toml; "
                         "install the test extra (pip install -e '.[test]': setuptools>=77)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(os.path.join(REPO, "tfpar"), src / "tfpar",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--wheel-dir", str(dist), str(src)],
                   check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = dist.glob("tfpar-*.whl")
    return str(wheel)


def fresh_venv(tmp_path) -> tuple[str, str]:
    """A venv without pip that sees this environment's site-packages; (bin, site-packages)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True,
                             timeout=60).stdout.strip()
    ours = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")
            and os.path.isdir(p)]
    assert ours and not any(os.path.isdir(os.path.join(p, "tfpar")) for p in ours), ours
    with open(os.path.join(purelib, "ci-environment.pth"), "w", encoding="utf-8") as f:
        f.write("\n".join(ours) + "\n")
    return str(venv / "bin"), purelib


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The installed commands' folder and a clean environment to run them in."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    bin_dir, purelib = fresh_venv(tmp)
    # pip comes from this environment's site-packages, through the .pth line; it installs
    # into the venv it runs in. --ignore-installed: the editable tfpar it sees there is
    # another environment's, neither to uninstall nor to count as installed.
    subprocess.run([os.path.join(bin_dir, "python"), "-m", "pip", "install", "--quiet",
                    "--no-deps", "--no-index", "--ignore-installed", wheel],
                   check=True, capture_output=True, text=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    work = tmp / "work"  # outside the clone
    work.mkdir()
    where = subprocess.run([os.path.join(bin_dir, "python"), "-c",
                            "import tfpar.tools.commands as m; print(m.__file__)"],
                           cwd=work, env=env, check=True, capture_output=True, text=True,
                           timeout=60).stdout.strip()
    assert where == os.path.join(purelib, "tfpar", "tools", "commands.py")
    return {"bin": bin_dir, "env": env, "work": work, "wheel": wheel}


def command(installed, name, *args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(installed["bin"], name), *map(str, args)],
                            cwd=installed["work"], env=installed["env"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def finish(proc: subprocess.Popen, timeout=300) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{proc.args[0]}: status {proc.returncode}\n{out}\n{err}"
    return out, err


def test_the_wheel_holds_the_package_its_commands_and_no_tfds_requirement(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = wheel.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = wheel.read(f"{info}/METADATA").decode()
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert all(n.startswith(("tfpar/", info + "/")) for n in names)  # no scripts/, tests/
    # Every module of tfpar/ and no other: the source tree is what test_package checks for
    # the harness (fault injection, the benchmarks only the suite and docs use).
    sources = {p.relative_to(REPO).as_posix() for p in pathlib.Path(REPO, "tfpar").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == sources
    assert sorted(re.findall(r"^(tfpar-\w+) = tfpar\.tools\.commands:\w+$", entry_points,
                             re.M)) == sorted(COMMANDS)
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    tfds = [r for r in requires if r.startswith("tensorflow-datasets")]
    assert tfds and all("extra ==" in r for r in tfds), requires  # only with [tfds], [test]


def test_every_installed_command_works_outside_the_clone(installed):
    work = installed["work"]
    # The cluster job runs beside the single-process one (two cores: wall time).
    launch = command(installed, "tfpar-launch", "--workers", "2", "--", "--strategy",
                     "multi_worker", *TINY, "--max-steps", "2", "--no-export",
                     "--model-dir", work / "mw", "--metrics-json", work / "mw.json")
    train = command(installed, "tfpar-train", *TINY, "--max-steps", "3", "--model-dir",
                    work / "run", "--export-dir", work / "export", "--metrics-json",
                    work / "m.json")
    helps = {name: command(installed, name, "--help") for name in COMMANDS}
    for name, proc in helps.items():
        out, _ = finish(proc)
        assert out.startswith(f"usage: {name} "), (name, out[:200])

    _, err = finish(train)
    assert "I tfpar.training.run: " in err  # tfpar's log shows
    assert not NATIVE.search(err), NATIVE.search(err).group(0)  # TF's chatter does not
    metrics = json.loads((work / "m.json").read_text())
    assert metrics["steps"] == 3 and os.path.isdir(metrics["export_path"])
    out, _ = finish(command(installed, "tfpar-generate", "--model", work / "export" / "tfpar_lm",
                            "--max-tokens", "5", "--seed", "1", "--prompt", "ka"))
    assert out.startswith("[ka] ") and len(out.split()) > 1, out

    out, err = finish(launch)
    assert out.count("[launch] started worker") == 2, out
    mw = json.loads((work / "mw.json").read_text())
    assert (mw["strategy"], mw["workers"], mw["steps"]) == ("multi_worker", 2, 2)
