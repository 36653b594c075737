"""A quiet console: TensorFlow's native (C++) start-up chatter kept off stderr.

TensorFlow's C++ runtime logs through absl straight to file descriptor 2, and some of its
lines ignore ``TF_CPP_MIN_LOG_LEVEL`` (absl's "All log messages before
absl::InitializeLog() ..." preamble, oneDNN's notice, "Could not find cuda drivers",
``cuInit`` failing on a host without a GPU). No Python logging setting reaches them, so a
script calls :func:`quiet_native_logs` first, before TensorFlow is imported: fd 2 is
replaced by a pipe that a thread copies to the real stderr, line by line, leaving out

- native lines of severity I (info) and W (warning), and absl's preamble;
- native E (error) lines that are known not to be errors on this kind of host
  (:data:`BENIGN_ERRORS`: no GPU, oneDNN falling back to Eigen for a dtype, ...).

Every other line passes unchanged and in order: Python's own output (tfpar's log,
progress bars, tracebacks), native F (fatal) lines and every other native E line, so a
real error is never hidden. On a host that should have GPUs (an NVIDIA device node, or
``CUDA_VISIBLE_DEVICES`` naming devices: :func:`tfpar.parallel.host.gpus_expected`) the
GPU library and driver lines of every severity pass too (:data:`GPU_LINE`: "Cannot
dlopen some GPU libraries", ``cuInit`` failing, devices created): there they are the
news, not the noise. ``-v`` / ``--verbose`` (or ``--log-device-placement``,
whose output is native I lines) turns the filter off.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from typing import Sequence

# absl's native line: severity letter, MMDD, time, thread, file:line]
NATIVE = re.compile(rb"^[IWEF]\d{4} [\d:.]+ +\d+ [^ \]]+:\d+\] ")
PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called"
# Native E lines that report no error on a host without a GPU (or on a CPU without
# AVX-512 for some dtype), matched on the file:line] part and the message.
BENIGN_ERRORS = re.compile(
    rb"(cuda_platform\.cc:\d+\] failed call to cuInit"
    rb"|cuda_(?:dnn|fft|blas)\.cc:\d+\] Unable to register"
    rb"|util\.cc:\d+\] oneDNN supports DT_\w+ only on platforms with"
    rb"|function_handle_cache\.cc:\d+\] Failed to clear function handle cache"
    rb"|computation_placer\.cc:\d+\] computation placer already registered"
    rb"|node_def_util\.cc:\d+\] NodeDef mentions attribute \w+ which is not in the op "
    rb"definition)")
# Native lines about GPUs, their libraries and driver (shown where GPUs are expected),
# except the factory-registration notices every CUDA build prints twice on any host.
GPU_LINE = re.compile(rb"GPU|[Cc][Uu][Dd][Aa]|cuInit|cu[Dd][Nn][Nn]|dlopen|NVIDIA|nvidia")
REGISTRATION = re.compile(rb"cuda_(?:dnn|fft|blas)\.cc:\d+\] Unable to register")
VERBOSE_FLAGS = ("-v", "--verbose", "--log-device-placement")


def hidden(line: bytes, show_gpu: bool = False) -> bool:
    """Whether a complete stderr line is native chatter to leave out; with ``show_gpu``
    (this host should have GPUs) no GPU, CUDA or driver line is."""
    if line.startswith(PREAMBLE):
        return True
    if not NATIVE.match(line):
        return False
    if show_gpu and GPU_LINE.search(line) and not REGISTRATION.search(line):
        return False
    return line[:1] in (b"I", b"W") or bool(BENIGN_ERRORS.search(line))


def may_become_native(partial: bytes) -> bool:
    """Whether an unfinished line could still turn out to be a hidden one (so it waits
    for its newline); anything else, a progress bar's ``\\r`` update say, is written at
    once."""
    probe = partial[:len(PREAMBLE)]
    if PREAMBLE.startswith(probe):
        return True
    return bool(re.match(rb"^[IWEF]\d{0,4}( [\d:.]*( +\d*( [^ \]]*)?)?)?$", partial[:80])) \
        or bool(NATIVE.match(partial))


class LineFilter:
    """Copies bytes to ``write`` with :func:`hidden` lines left out."""

    def __init__(self, write, show_gpu: bool = False):
        self.write, self.show_gpu = write, show_gpu
        self.pending = b""  # an unfinished line held back
        self.passing = False  # the unfinished line was already (partly) written

    def feed(self, data: bytes) -> None:
        lines = (self.pending + data).split(b"\n")
        self.pending = b""
        for line in lines[:-1]:
            if self.passing:
                self.write(line + b"\n")
                self.passing = False
            elif not hidden(line + b"\n", self.show_gpu):
                self.write(line + b"\n")
        last = lines[-1]
        if last:
            if self.passing or not may_become_native(last):
                self.write(last)
                self.passing = True
            else:
                self.pending = last

    def close(self) -> None:
        if self.pending and not hidden(self.pending, self.show_gpu):
            self.write(self.pending)
        self.pending = b""


def quiet_native_logs(argv: Sequence[str] | None = None) -> bool:
    """Filters fd 2 for the rest of the process unless ``argv`` asks for verbose logs.

    Call it first in a script, before TensorFlow is imported. Child processes inherit
    the filtered stderr. Returns whether the filter was installed.
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a in VERBOSE_FLAGS for a in argv) or os.environ.get("TFPAR_NATIVE_LOGS") == "1":
        return False
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    def write_all(data: bytes) -> None:
        while data:
            data = data[os.write(real, data):]

    from tfpar.parallel.host import gpus_expected

    line_filter = LineFilter(write_all, show_gpu=gpus_expected() is not None)

    def pump():
        while True:
            try:
                data = os.read(read_end, 65536)
            except OSError:
                break
            if not data:
                break
            line_filter.feed(data)
        line_filter.close()

    thread = threading.Thread(target=pump, name="native-log-filter", daemon=True)
    thread.start()

    def restore():
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(real, 2)  # closes this process's write end of the pipe: the pump ends
        thread.join(timeout=5)

    atexit.register(restore)
    return True
