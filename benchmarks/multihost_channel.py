"""How long process 0 takes to hand one step's packed batch to the other processes, two ways.

    python -m serving.launch --num_processes=2 --devices_per_process=2 -- \\
        python benchmarks/multihost_channel.py --steps 200 --result benchmarks/results/multihost_channel_cpu.json

* `kv`: `serving.cluster.distributed.Channel`, what multi-host serving uses: process 0
  writes the pickled (ibuf, fbuf, shape) to the coordination service's
  key-value store; the others block on the key.
* `collective`: `jax.experimental.multihost_utils.broadcast_one_to_all` of the
  same two buffers (a jitted all-reduce over every device, gloo on CPU), after
  broadcasting their sizes, which the receivers need first.

Each round trip ends with every process holding the batch and process 0
knowing it (an acknowledgement comes back the same way), so the figure is the
per-step latency the transport adds. Printed side by side, with the ratio;
process 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from serving.cluster import distributed  # noqa: E402


def step_buffers(T: int, S: int, P: int):
    from serving.core.input_batch import StepShape

    shape = StepShape(T, S, P)
    ibuf, fbuf, _ = shape.empty(0)
    rng = np.random.default_rng(0)
    ibuf[:] = rng.integers(0, 1000, ibuf.shape)
    fbuf[:] = rng.random(fbuf.shape)
    return ibuf, fbuf, shape


_kv_rounds = 0


def time_kv(steps: int, payload) -> float:
    import jax

    global _kv_rounds
    client = distributed.coordination_client()
    me, n = jax.process_index(), jax.process_count()
    _kv_rounds += 1
    down = distributed.Channel(client, me, n, namespace=f"bench/down{_kv_rounds}")
    t0 = time.perf_counter()
    for i in range(steps):
        ack = f"bench/ack{_kv_rounds}/{i}"
        if me == 0:
            down.send(("call", "step", payload[:2], {"shape": payload[2]}))
            for p in range(1, n):
                client.blocking_key_value_get(f"{ack}/{p}", 60_000)
                client.key_value_delete(f"{ack}/{p}")
        else:
            down.receive(60)
            client.key_value_set(f"{ack}/{me}", "1")
    return (time.perf_counter() - t0) / steps


def time_collective(steps: int, payload) -> float:
    import jax
    from jax.experimental import multihost_utils

    ibuf, fbuf, _ = payload
    me = jax.process_index()
    for _ in range(3):  # compile both shapes first
        multihost_utils.broadcast_one_to_all(np.array([ibuf.size, fbuf.size], np.int32))
        multihost_utils.broadcast_one_to_all((ibuf, fbuf))
    t0 = time.perf_counter()
    for _ in range(steps):
        sizes = multihost_utils.broadcast_one_to_all(np.array([ibuf.size, fbuf.size], np.int32))
        src = (ibuf, fbuf) if me == 0 else (np.zeros(int(sizes[0]), np.int32), np.zeros(int(sizes[1]), np.float32))
        out = multihost_utils.broadcast_one_to_all(src)
        np.asarray(out[0])
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--shapes", default="32x8x16,512x64x128", help="TxSxP step shapes, comma-separated")
    ap.add_argument("--result", default=None)
    args = ap.parse_args()
    distributed.initialize()
    import jax

    rows = []
    for text in args.shapes.split(","):
        T, S, P = (int(x) for x in text.split("x"))
        payload = step_buffers(T, S, P)
        nbytes = payload[0].nbytes + payload[1].nbytes
        time_kv(5, payload)  # warm the connections
        kv = time_kv(args.steps, payload)
        coll = time_collective(args.steps, payload)
        rows.append({"shape": text, "bytes": nbytes, "kv_ms": kv * 1e3, "collective_ms": coll * 1e3,
                     "collective_over_kv": coll / kv})
    if jax.process_index() == 0:
        print(f"{jax.process_count()} processes x {jax.local_device_count()} {jax.devices()[0].platform} devices, "
              f"{args.steps} round trips each")
        print(f"{'step shape':>14} {'bytes':>8} {'kv store ms':>12} {'collective ms':>14} {'ratio':>6}")
        for r in rows:
            print(f"{r['shape']:>14} {r['bytes']:>8} {r['kv_ms']:>12.3f} {r['collective_ms']:>14.3f} "
                  f"{r['collective_over_kv']:>6.2f}")
        if args.result:
            with open(args.result, "w") as f:
                json.dump({"processes": jax.process_count(), "devices_per_process": jax.local_device_count(),
                           "platform": jax.devices()[0].platform, "machine": platform.machine(),
                           "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
