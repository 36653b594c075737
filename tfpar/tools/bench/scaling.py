"""A scaling model for what this host cannot run: N GPUs in a node, N workers on a network.

Data parallelism splits a global batch over ``N`` devices; every step each device
computes its share, then the gradients are summed over all of them (a ring all-reduce)
and every device applies the same update. The model predicts one step's time::

    t(N) = t_compute(N) + (1 - overlap) * t_allreduce(N) + t_host

    t_compute(N)   = F / N / R  +  t_serial
    t_allreduce(N) = ring(G) + S * ring(4 bytes)                          (0 for N = 1)
    ring(b)        = 2 (N - 1) / N * b / bw  +  2 (N - 1) * latency

* ``F``: the step's FLOPs at the global batch (:mod:`tfpar.tools.bench.roofline`);
  ``R``: the FLOP/s a device sustains on them (``peak * efficiency``).
* ``t_serial``: what does not shrink with the batch share: the recurrence is a chain of
  ``T`` dependent steps per layer, forward and backward, each a few kernels; on a GPU each
  costs at least a kernel launch (``launch_latency * kernels_per_time_step * 2 L T``).
* ``G``: the gradient bytes all-reduced per step: every trainable variable, float32 and
  dense (tfpar densifies the embedding's sparse gradient before the all-reduce).
* ``S``: the scalar collectives of a step, latency-bound: tfpar's synchronous step sums
  the real-token count before the gradients (every replica divides by it) and the loss
  and token sums after them, :data:`SMALL_COLLECTIVES`.
* ``overlap``: the share of the all-reduce hidden behind the backward pass. tfpar's
  synchronous strategies all-reduce after the whole backward pass (Keras' optimizer
  reduces in ``apply``), so it is 0 here; frameworks that bucket gradients during the
  backward pass (Horovod, PyTorch DDP) reach most of 1 when compute dominates.
* ``t_host``: the host's own time per step between two steps (Python, the
  ``tf.function`` call, reading the loss back), measured here from
  ``--steps-per-execution`` 1 against 10; ``--steps-per-execution N`` divides it by N.

**Strong scaling** keeps tfpar's global ``--batch-size`` (each device gets 1/N of it);
**weak scaling** keeps the per-device batch (the global batch grows with N, as in the
published multi-GPU figures). Speed-up is ``N t(1) / t(N)`` tokens per second for weak,
``t(1) / t(N)`` for strong; efficiency is speed-up over N.

Checked here against what this host can run: N worker processes on loopback, where the
devices are the host's cores shared N ways (so compute does not shrink: N processes on
2 cores each get 2/N of them) and the link is loopback gRPC, whose bandwidth and latency
are measured by all-reducing tensors of two sizes between the very processes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


SMALL_COLLECTIVES = 3


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator (or this host's CPU) and the link between devices."""

    name: str
    peak_flops: float  # FLOP/s of the step's matmuls at the precision trained (dense)
    efficiency: float  # the share of peak the step's matmuls sustain
    link_bandwidth: float  # bytes/s each way between neighbours in the ring
    link_latency: float  # seconds per message hop
    launch_latency: float = 0.0  # seconds per kernel launch (GPUs)
    kernels_per_time_step: int = 4  # per layer and direction: the matmul and the gates
    memory_bytes: float = 0.0  # device memory (for the table; the model is small)

    @property
    def flops(self) -> float:
        return self.peak_flops * self.efficiency


# H100 SXM-class: TF32 dense 495 TFLOP/s (fp32 training on tensor cores; bf16 989), 80 GB
# HBM3 at 3.35 TB/s, NVLink 4 at 450 GB/s each way. An LSTM LM's matmuls are small (a few
# hundred rows), so they sustain a small share of the tensor cores' peak.
H100_NVLINK = Device("H100 SXM (NVLink)", peak_flops=495e12, efficiency=0.15,
                     link_bandwidth=450e9, link_latency=3e-6, launch_latency=4e-6,
                     memory_bytes=80e9)
# H200-class nodes over 400 Gb/s InfiniBand (one NIC per GPU): the workers' link.
H200_IB = Device("H200 (400 Gb/s InfiniBand)", peak_flops=495e12, efficiency=0.15,
                 link_bandwidth=50e9, link_latency=5e-6, launch_latency=4e-6,
                 memory_bytes=141e9)
# Workers on a commodity 25 Gb/s Ethernet, each with one such GPU.
H100_ETHERNET = dataclasses.replace(H100_NVLINK, name="H100 (25 Gb/s Ethernet)",
                                    link_bandwidth=25e9 / 8, link_latency=30e-6)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step is, at the global batch."""

    flops: float  # FLOPs of one step (forward and backward)
    tokens: int  # tokens of one step
    gradient_bytes: float  # all-reduced per step
    layers: int
    bptt: int


def allreduce_seconds(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` devices: reduce-scatter then all-gather,
    ``2 (n - 1)`` hops each moving ``nbytes / n``."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


def communication_seconds(n: int, gradient_bytes: float, bandwidth: float,
                          latency: float) -> float:
    """A step's collectives: the gradients' all-reduce and :data:`SMALL_COLLECTIVES`
    scalar ones."""
    return (allreduce_seconds(n, gradient_bytes, bandwidth, latency)
            + SMALL_COLLECTIVES * allreduce_seconds(n, 4.0, bandwidth, latency))


def fit_link(sizes: Sequence[float], seconds: Sequence[float], n: int) -> tuple[float, float]:
    """``(bandwidth, latency)`` of the ring model through two measured all-reduces
    (``sizes`` bytes took ``seconds``) over ``n`` devices: a straight line in bytes."""
    (b0, b1), (t0, t1) = sizes, seconds
    per_byte = max((t1 - t0) / (b1 - b0), 1e-15)  # seconds per byte of the ring term
    ring = 2.0 * (n - 1) / n
    bandwidth = ring / per_byte
    latency = max(0.0, (t0 - ring * b0 / bandwidth) / (2.0 * (n - 1)))
    return bandwidth, latency


def serial_seconds(work: Workload, device: Device) -> float:
    """The recurrence's chain of kernel launches, which no batch split shortens."""
    return device.launch_latency * device.kernels_per_time_step * 2 * work.layers * work.bptt


def step_seconds(work: Workload, device: Device, n: int, *, host_seconds: float,
                 overlap: float = 0.0, weak: bool = False,
                 compute_seconds: float | None = None) -> dict[str, float]:
    """The predicted step on ``n`` devices: ``{"compute", "allreduce", "host", "step"}``.

    ``weak``: every device keeps the whole ``work`` (the global batch grows ``n``-fold);
    else it gets ``1/n`` of it. ``compute_seconds``: the compute time of one device's
    share when it is known (measured) rather than modelled."""
    if compute_seconds is None:
        share = work.flops if weak else work.flops / n
        compute_seconds = share / device.flops + serial_seconds(work, device)
    comm = communication_seconds(n, work.gradient_bytes, device.link_bandwidth,
                                 device.link_latency)
    step = compute_seconds + (1.0 - overlap) * comm + host_seconds
    return {"compute": compute_seconds, "allreduce": comm, "host": host_seconds, "step": step}


def scaling_table(work: Workload, device: Device, counts: Sequence[int], *,
                  host_seconds: float, overlap: float = 0.0, weak: bool = False
                  ) -> list[dict[str, float]]:
    """One row per device count: predicted step ms, tokens/s, speed-up and efficiency."""
    base = step_seconds(work, device, 1, host_seconds=host_seconds, weak=weak)["step"]
    rows = []
    for n in counts:
        t = step_seconds(work, device, n, host_seconds=host_seconds, overlap=overlap, weak=weak)
        tokens = work.tokens * (n if weak else 1)
        speedup = (n * base / t["step"]) if weak else base / t["step"]
        rows.append({"n": n, "step_ms": t["step"] * 1e3, "compute_ms": t["compute"] * 1e3,
                     "allreduce_ms": t["allreduce"] * 1e3, "host_ms": t["host"] * 1e3,
                     "tokens_per_sec": tokens / t["step"], "speedup": speedup,
                     "efficiency": speedup / n})
    return rows
