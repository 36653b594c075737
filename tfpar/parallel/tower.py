"""Tower data parallelism by hand: TF1's ``cifar10_multi_gpu_train`` pattern, in TF 2.

One process and no ``tf.distribute``: the plug-in places every op itself. It is the
``parallel_do`` strategy (``tfpar.parallel.parallel_do``: split, run, merge) with a choice
of variable device and of reduction. Each global
batch is split inside the step into one row shard per tower device (sizes differ by at
most one row, ``tfpar.parallel.rows.split``); each tower runs the forward pass and its
gradients on its own device against the ONE set of weights that lives on the variable
device; the towers' gradients are summed, clipped by global norm and applied once::

    variable device (/cpu:0 when the towers are GPUs, else the first tower)
    +-------------------------------------------------------------------------+
    | global batch [B, T] -> row shards 0 .. K-1 (sizes differ by <= 1)       |
    | N = real tokens of the whole batch;  weights theta (ONE copy)           |
    +---------+-----------------------+-----------------------------+---------+
              | shard 0, N, theta     | shard 1, N, theta           | shard K-1
              v                       v                             v
    +-------------------+   +-------------------+         +-------------------+
    | tower 0  (/gpu:0) |   | tower 1  (/gpu:1) |   ...   | tower K-1         |
    | forward -> nll_0  |   | forward -> nll_1  |         | forward           |
    | g_0 = d(nll_0/N)  |   | g_1 = d(nll_1/N)  |         | g_K-1             |
    +---------+---------+   +---------+---------+         +---------+---------+
              | controller: every g_i goes to the variable device   |
              | ring: chunks of g_i pass tower -> tower (see below) |
              v                       v                             v
    +-------------------------------------------------------------------------+
    | variable device: g = g_0 + .. + g_K-1; g *= c / max(|g|, c); apply once |
    +-------------------------------------------------------------------------+

Each tower differentiates ``nll_sum / N`` with ``N`` the *global* token count, so the plain
sum of the towers' gradients is the gradient one device computes on the whole batch, however
unevenly real tokens fall (a shard with no rows becomes one padding row: zero loss, zero
gradient). Clipping comes after the sum, and the Keras optimizer, used outside any
``tf.distribute`` strategy, applies the combined gradient once (it all-reduces nothing).

``--tower-reduce ring`` replaces the gather by a chunked ring all-reduce across the tower
devices (reduce-scatter, then all-gather): each tower flattens its gradients into one
vector and cuts it into K chunks; every step, tower i sends one chunk to tower i+1, so
each link carries 2(K-1)/K of one gradient in total instead of the controller receiving K
whole gradients; sparse gradients (the sampled softmax's ``tf.IndexedSlices``, of no fixed
length) go round the ring whole instead, an all-gather. Variables live in one place here, so the variable device takes its
copy of the result from the tower it shares a device with (tower 0 otherwise).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfpar.config import DistConfig, ModelConfig
from tfpar.parallel import devices as devices_lib
from tfpar.parallel.parallel_do import ParallelDo


class TowerPlugin(ParallelDo):
    """Hand-placed towers sharing one set of weights on ``variable_device``: the
    ``parallel_do`` split -> run -> merge, with the merge a controller gather or a ring."""

    name = "tower"
    replica_scope = "tower"

    def __init__(self, device_names: list[str], variable_device: str, reduce: str):
        super().__init__(device_names, variable_device)
        self.reduce = reduce

    def describe(self) -> str:
        return (f"{super().describe()}; variables on {self.variable_device}, "
                f"{self.reduce} gradient reduction")

    def sum_gradients(self, grads, variables, combine):
        if self.reduce == "ring" and self.num_replicas > 1:
            return self._ring_sum([list(g) for g in zip(*(p.values for p in grads))],
                                  [v.shape for v in variables], combine)
        return super().sum_gradients(grads, variables, combine)

    def _ring_sum(self, tower_grads: list[list], shapes: list, combine) -> list:
        sparse = [isinstance(g, tf.IndexedSlices) for g in tower_grads[0]]
        dense = [i for i, s in enumerate(sparse) if not s]
        # The variable device takes the copy of the tower it shares a device with.
        source = next((i for i, d in enumerate(self.devices)
                       if devices_lib.same_device(d, self.variable_device)), 0)
        out = [None] * len(shapes)
        if dense:
            summed = self._ring_sum_dense([[g[i] for i in dense] for g in tower_grads],
                                          [shapes[i] for i in dense], source)
            with tf.device(self.variable_device), tf.name_scope("ring_result"):
                for i, g in zip(dense, summed):
                    out[i] = combine([g])  # the ring added the parts: the form only
        for i in (i for i, s in enumerate(sparse) if s):
            # tf.IndexedSlices have no fixed length to cut into chunks: their rows go
            # round the ring whole (an all-gather), and every tower sums the same rows.
            gathered = ring_all_gather([g[i] for g in tower_grads], self.devices)
            with tf.device(self.variable_device), tf.name_scope("ring_result"):
                out[i] = combine(gathered[source])
        return out

    def _ring_sum_dense(self, tower_grads, shapes, source):
        # Static sizes (from the variables: some gradients of the RNN loop have none).
        sizes = [int(np.prod(s)) for s in shapes]
        vectors = []
        for i, (device, grads) in enumerate(zip(self.devices, tower_grads)):
            with tf.device(device), tf.name_scope(f"ring_flatten_{i}"):
                vectors.append(tf.concat(
                    [tf.reshape(g, [size]) for g, size in zip(grads, sizes)], axis=0))
        reduced = ring_all_reduce(vectors, self.devices)
        with tf.device(self.variable_device), tf.name_scope("ring_result"):
            parts = tf.split(reduced[source], sizes)
            return [tf.reshape(p, s) for p, s in zip(parts, shapes)]


def ring_all_gather(slices: list[tf.IndexedSlices], device_names: list[str]) -> list[list]:
    """Every device's ``tf.IndexedSlices`` on every device, passed round the ring: at
    step s (K-1 steps) device i hands device i+1 the piece of device (i - s) mod K.

    Returns:
      Per device, the K pieces in device order (a copy of each on that device).
    """
    k = len(device_names)
    held = [{i: slices[i]} for i in range(k)]
    for s in range(k - 1):
        for i in range(k):
            dst, origin = (i + 1) % k, (i - s) % k
            piece = held[i][origin]
            with tf.device(device_names[dst]), tf.name_scope(f"ring_all_gather_sparse_{s}"):
                held[dst][origin] = tf.IndexedSlices(tf.identity(piece.values),
                                                     tf.identity(piece.indices),
                                                     piece.dense_shape)
    return [[held[d][i] for i in range(k)] for d in range(k)]


def ring_all_reduce(vectors: list[tf.Tensor], device_names: list[str]) -> list[tf.Tensor]:
    """Sums equal-length 1-D ``vectors`` (one per device) with a ring all-reduce.

    Every vector is cut into K chunks (K devices). Reduce-scatter, K-1 steps: at step s
    device i sends chunk (i - s) mod K to device i+1, which adds it to its own copy (the
    add runs on the receiver). Afterwards device i holds the full sum of chunk (i+1) mod K.
    All-gather, K-1 steps: at step s device i sends its finished chunk (i + 1 - s) mod K to
    device i+1, which keeps it. Picture for K = 3 (chunk c of device d: c@d)::

        reduce-scatter s=0: 0@0 -> 1   1@1 -> 2   2@2 -> 0
        reduce-scatter s=1: 2@0 -> 1   0@1 -> 2   1@2 -> 0   (dev 0 has sum 1, 1: 2, 2: 0)
        all-gather     s=0: 1@0 -> 1   2@1 -> 2   0@2 -> 0
        all-gather     s=1: 0@0 -> 1   1@1 -> 2   2@2 -> 0   (every device has every sum)

    Returns:
      One summed vector per device, each placed on its device.
    """
    k = len(device_names)
    if k == 1:
        return list(vectors)
    length = int(vectors[0].shape[0])
    sizes = [len(c) for c in np.array_split(np.arange(length), k)]
    chunks = []
    for i, device in enumerate(device_names):
        with tf.device(device), tf.name_scope(f"ring_chunks_{i}"):
            chunks.append(list(tf.split(vectors[i], sizes)))
    for s in range(k - 1):
        for i in range(k):
            dst, c = (i + 1) % k, (i - s) % k
            with tf.device(device_names[dst]), tf.name_scope(f"ring_reduce_scatter_{s}"):
                chunks[dst][c] = chunks[dst][c] + chunks[i][c]
    for s in range(k - 1):
        for i in range(k):
            dst, c = (i + 1) % k, (i + 1 - s) % k
            with tf.device(device_names[dst]), tf.name_scope(f"ring_all_gather_{s}"):
                chunks[dst][c] = tf.identity(chunks[i][c])
    out = []
    for i, device in enumerate(device_names):
        with tf.device(device), tf.name_scope(f"ring_concat_{i}"):
            out.append(tf.concat(chunks[i], axis=0))
    return out


def default_variable_device(tower_devices: list[str]) -> str:
    """The first tower's device, GPU towers included. ``cifar10_multi_gpu_train`` kept the
    weights on the host CPU (``--variable-device cpu``), which on today's GPUs, with
    peer-to-peer links far faster than PCIe to the host, makes every step copy all
    weights to each GPU and every gradient back through the host."""
    return tower_devices[0]


def build_tower(dist: DistConfig, model: ModelConfig | None = None) -> TowerPlugin:
    """Towers on ``--devices``, all GPUs, or ``--cpu-devices`` logical CPUs (default 2).

    Raises:
      DeviceError: a tower or the variable device does not exist on this host.
    """
    names = devices_lib.data_parallel_devices(dist)
    if dist.variable_device:
        # "cpu": the host CPU, TF1's cifar10_multi_gpu_train placement.
        wanted = "/cpu:0" if dist.variable_device.lower() == "cpu" else dist.variable_device
        variable_device = devices_lib.resolve_devices((wanted,))[0]
    else:
        variable_device = default_variable_device(names)
    return TowerPlugin(names, variable_device, dist.tower_reduce)
