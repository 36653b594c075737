"""The two-device contenders' child process: its protocol, both sides.

The parent starts ``python -m tfpar.tools.bench --serve <request>``; the child sets up
its own TF runtime (logical devices, thread pools), builds the contenders, and answers
one JSON line per line it is sent::

    child  -> {"status": {name: "ok" | "failed: ..." | "not available"}}    (once, ready)
    parent -> {"name": name, "steps": n}
    child  -> a Segment's fields, or {"error": "ValueError: ..."} when the segment raised
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import NoReturn, Sequence

from tfpar.parallel.cluster.local_job import package_env
from tfpar.tools.bench.contenders import (Contender, ContenderFailed, Segment, build_available,
                                          describe)
from tfpar.tools.bench.spec import BenchSpec
from tfpar.tools.bench.workload import load_setup

log = logging.getLogger("tfpar.tools.bench")


class RemoteContender(Contender):
    """A contender that lives in a child process (its own TF runtime: logical devices and
    thread pools); ``segment`` asks it to train and waits, so timings stay interleaved
    with the parent's contenders."""

    def __init__(self, name: str, server: "ContenderServer"):
        self.name, self.server = name, server

    def segment(self, steps: int) -> Segment:
        reply = self.server.ask({"name": self.name, "steps": steps})
        if "error" in reply:
            raise ContenderFailed(self.name, reply["error"])
        return Segment(**reply)


class ContenderServer:
    """``python -m tfpar.tools.bench --serve``: a child process hosting some contenders."""

    def __init__(self, spec: BenchSpec, names: Sequence[str]):
        import subprocess

        request = json.dumps({"spec": dataclasses.asdict(spec), "names": list(names)})
        # The parent's working directory: the spec's corpus (``ptb``: input/ptb/, or a
        # relative folder) is read from there as in the parent.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tfpar.tools.bench", "--serve", request],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=package_env(os.environ))
        try:
            ready = self._read()
        except RuntimeError as e:  # it crashed setting up: every contender it hosts failed
            raise ContenderFailed(", ".join(names), str(e)) from None
        self.status: dict[str, str] = ready["status"]  # name -> "ok" | "failed: ..."

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark child process exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def contenders(self) -> dict[str, RemoteContender]:
        return {n: RemoteContender(n, self) for n, s in self.status.items() if s == "ok"}

    def close(self) -> None:
        """Closes the child's stdin (its cue to leave) and waits for it to exit; a child
        still there after 60 s is killed (every segment has been answered by then)."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log.warning("benchmark child process still running 60 s after its last "
                            "request: killed it")
                self.proc.kill()
                self.proc.wait()


def serve(request: str) -> NoReturn:
    """The child side of :class:`ContenderServer`: sets up its runtime as
    ``scripts/train.py`` would for two logical CPU devices, builds the contenders, then
    answers ``{"name", "steps"}`` requests with a Segment (or the error that segment
    raised), one JSON line each. Ends the process (status 0) when its stdin closes."""
    from tfpar.config import DistConfig
    from tfpar.tools.cli import prepare_runtime

    out = os.fdopen(os.dup(1), "w")  # the protocol's channel; anything else printed -> stderr
    os.dup2(2, 1)
    req = json.loads(request)
    spec = BenchSpec(**req["spec"])
    prepare_runtime(DistConfig(strategy="mirrored", cpu_devices=2))  # train.py's own set-up
    built, failed = build_available(load_setup(spec), req["names"], spec.warmup)
    out.write(json.dumps({"status": {**failed, **{n: "ok" for n in built}}}) + "\n")
    out.flush()
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            reply = dataclasses.asdict(built[ask["name"]].segment(ask["steps"]))
        except Exception as e:  # the parent names the contender and stops the run
            log.warning("%s failed: %s", ask["name"], e)
            reply = {"error": describe(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    sys.stderr.flush()
    # Leave without TensorFlow's teardown: after the distributed contenders it took up to
    # a minute on a busy 2-core host, and the parent waits for this process to end.
    os._exit(0)
