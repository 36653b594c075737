#!/usr/bin/env python3
"""The picture of TensorBoard in the docs, regenerated: ``python scripts/tensorboard_screenshot.py``.

1. trains two short runs into a temporary ``runs/`` (the synthetic corpus, a small LSTM,
   three epochs; the two differ only in ``--lr``), as ``make train`` does but smaller;
2. starts the venv's ``tensorboard --logdir runs/`` on a free local port and waits until
   it serves both runs' eval curves and their HParams sessions;
3. takes a PNG of one page with headless Chromium (``apt-get install chromium``; no
   network beyond 127.0.0.1 is needed or used) and writes it to ``--out``
   (default ``tfpar/docs/tensorboard.png``).

``--page timeseries`` (the default, TensorBoard's first tab), ``scalars`` or ``hparams``.
Nothing runs at import time; ``main(argv)`` returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "tfpar" / "docs" / "tensorboard.png"
# forceSVG: Time Series draws its charts with WebGL, which headless Chromium without a
# GPU does not give it (the charts come out empty); TensorBoard's SVG renderer draws them.
PAGES = {"timeseries": "?forceSVG=true#timeseries", "scalars": "#scalars",
         "hparams": "#hparams"}
# Two runs that differ in one setting: the HParams tab then has something to compare.
RUNS = {"lstm-lr3e-3": ["--lr", "3e-3"], "lstm-lr1e-2": ["--lr", "1e-2"]}
TRAIN_FLAGS = ["--data", "synthetic", "--synthetic-sentences", "1500,150,150",
               "--layers", "1", "--embed-dim", "32", "--hidden-dim", "64", "--dropout", "0",
               "--optimizer", "adam", "--clip-norm", "5", "--batch-size", "32",
               "--epochs", "3", "--log-every", "5", "--no-export", "--no-progress"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
WAIT_SECONDS = 120  # for TensorBoard to serve the runs


class ScreenshotError(Exception):
    """A step that failed; main prints it as one line and exits 1."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tensorboard_screenshot.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(OUT), help="the PNG to write (default: %(default)s)")
    p.add_argument("--page", choices=sorted(PAGES), default="timeseries",
                   help="TensorBoard's tab to take (default: %(default)s)")
    p.add_argument("--size", default="1400,1200", metavar="W,H",
                   help="the browser window in pixels (default: %(default)s: the two "
                   "sections Time Series opens, loss and perplexity, fit in it)")
    p.add_argument("--render-ms", type=int, default=20000, metavar="MS",
                   help="Chromium's virtual time for the page to load its data and draw "
                   "(default: %(default)s)")
    p.add_argument("--keep", metavar="DIR", help="train into DIR and keep it (default: a "
                   "temporary folder, removed)")
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium",
                   help="the browser (default: %(default)s)")
    return p.parse_args(argv)


def train_runs(root: Path) -> Path:
    """The runs of :data:`RUNS` in ``root/runs`` (a run already there is kept)."""
    from tfpar.tools.cli import train_main

    runs = root / "runs"
    for name, flags in RUNS.items():
        if (runs / name / "final_step.json").exists():
            continue
        code = train_main([*TRAIN_FLAGS, *flags, "--model-dir", str(runs / name)])
        if code:
            raise ScreenshotError(f"the training run {name} failed (exit {code})")
    return runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(url: str) -> bool:
    """Whether TensorBoard serves every run's eval curve and HParams session."""
    try:
        with urllib.request.urlopen(url + "/data/plugin/scalars/tags", timeout=5) as r:
            tags = json.load(r)
        request = urllib.request.Request(
            url + "/data/plugin/hparams/experiment", data=b'{"experimentName": ""}',
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as r:
            experiment = json.load(r)
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return False
    return all("perplexity" in tags.get(f"{name}/eval", {}) for name in RUNS) and \
        bool(experiment.get("metricInfos"))


def start_tensorboard(logdir: Path) -> tuple[subprocess.Popen, str]:
    """``tensorboard --logdir logdir`` on a free port, once it serves the runs."""
    port = free_port()
    binary = Path(sys.executable).parent / "tensorboard"
    proc = subprocess.Popen(
        [str(binary), "--logdir", str(logdir), "--port", str(port), "--host", "127.0.0.1",
         "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ScreenshotError(f"tensorboard exited with {proc.returncode}: "
                                  f"{proc.stderr.read()[-2000:]}")
        if served(url):
            return proc, url
        time.sleep(0.5)
    stop(proc)
    raise ScreenshotError(f"tensorboard did not serve {logdir} within {WAIT_SECONDS} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def find_browser(chromium: str) -> str:
    """The browser's path (checked before anything is trained)."""
    path = shutil.which(chromium)
    if path is None:
        raise ScreenshotError(f"no browser {chromium!r}: install Chromium with "
                              "`apt-get install -y chromium`, or give --chromium PATH")
    return path


def screenshot(chromium: str, url: str, out: Path, *, size: str, render_ms: int) -> None:
    """A PNG of ``url`` by headless Chromium, in a throw-away profile."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tfpar-chromium-") as profile:
        done = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
             f"--window-size={size}", f"--virtual-time-budget={render_ms}",
             f"--screenshot={out}", url],
            capture_output=True, text=True, timeout=300)
    if done.returncode or not out.exists():
        raise ScreenshotError(f"chromium exited with {done.returncode} and wrote no {out}: "
                              f"{done.stderr[-2000:]}")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    try:
        chromium = find_browser(args.chromium)
        root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tfpar-tb-"))
        try:
            proc, url = start_tensorboard(train_runs(root))
            try:
                screenshot(chromium, url + "/" + PAGES[args.page], out, size=args.size,
                           render_ms=args.render_ms)
            finally:
                stop(proc)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    except ScreenshotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size:,} bytes): TensorBoard's {args.page} tab "
          f"on {', '.join(RUNS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
