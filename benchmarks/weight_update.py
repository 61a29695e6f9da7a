"""Weight updates of a running engine (`LLM.update_weights`): how long each kind takes against moving the bytes once.

    python benchmarks/weight_update.py              # ~4 min on 2 cores
    python benchmarks/weight_update.py --models embedded --updates 20

For the embedded model and the 30-layer 135M shape (a random bf16 Hugging
Face checkpoint written by transformers, served from its directory as
`serve MODEL` does; float32 on CPU), in one process with three CPU devices:

* **rebind**: weights that already have the engine's placement (new arrays,
  copies of `get_weights()`'s), taken as they are;
* **reshard**: the same weights on one device, into an engine with tensor
  parallelism (each leaf placed on the engine's sharding): 2-way for the
  embedded model, 3-way for the 135M shape (its 9 query and 3 KV heads do
  not split in two);
* **host**: the same weights as host numpy arrays (a trainer's CPU copy);
* **checkpoint**: a checkpoint directory read and applied as `POST
  /update_weights` does (`rl_routes.load_for_update`; the 135M shape's HF
  directory, converted once beforehand, as a server would have);

each against one `jax.device_put` of a host buffer of the same bytes
(`device_put_s`), the floor of moving them: the five alternate for
`--repeats` rounds, the order rotating (`attention_cpu_bench.best_of_rotating_rounds`),
best kept.
Then `--updates` rebinds in a row, counting programs compiled (must be 0),
and the time to the first token of a 16-token prompt right after an update
against the same request with no update before it (steady state), alternating,
best of `--repeats` each.

Writes benchmarks/results/weight_update_cpu.json (or `--out`).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import startup  # noqa: E402
from attention_cpu_bench import best_of_rotating_rounds  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.api.rl_routes import load_for_update  # noqa: E402
from serving.core.model_runner import compilation_count  # noqa: E402
from serving.llm import default_checkpoint_dir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
PROMPT = {"prompt_token_ids": list(range(1, 17))}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def measure(name: str, checkpoint: str, args) -> dict:
    llm = LLM(model=checkpoint)
    tp = 2 if llm.config.num_kv_heads % 2 == 0 else 3
    sharded = LLM(model=checkpoint, tensor_parallel_size=tp)
    for engine in (llm, sharded):
        engine.generate([PROMPT], ONE_TOKEN)  # the buckets this uses compiled
    weights = llm.get_weights()
    size = nbytes(weights)
    host_buffer = np.ones(size // 4, np.float32)
    fresh = jax.tree_util.tree_map(jnp.copy, weights)  # new arrays, the engine's placement
    one_device = jax.device_put(weights, jax.devices()[0])
    on_host = jax.tree_util.tree_map(np.asarray, weights)
    blocked = lambda engine: jax.block_until_ready(engine.get_weights())  # noqa: E731 (placed, not just queued)
    best = best_of_rotating_rounds({
        "device_put": lambda: jax.device_put(host_buffer).block_until_ready(),
        "rebind": lambda: (llm.update_weights(fresh), blocked(llm)),
        "reshard": lambda: (sharded.update_weights(one_device), blocked(sharded)),
        "host": lambda: (llm.update_weights(on_host), blocked(llm)),
        "checkpoint": lambda: (llm.update_weights(load_for_update(llm.engine, checkpoint)), blocked(llm)),
    }, args.repeats)
    row = {"model": name, "weight_bytes": size, "tensor_parallel_size": tp,
           **{f"{kind}_s": round(seconds, 4) for kind, seconds in best.items()},
           **{f"{kind}_vs_device_put": round(best[kind] / best["device_put"], 2)
              for kind in ("rebind", "reshard", "host", "checkpoint")}}
    llm.generate([PROMPT], ONE_TOKEN)
    before = compilation_count()
    for _ in range(args.updates):
        llm.update_weights(fresh)
    llm.generate([PROMPT], ONE_TOKEN)
    row["updates"] = args.updates
    row["compiled_during_updates"] = compilation_count() - before
    first_token = best_of_rotating_rounds({
        "steady": lambda: llm.generate([PROMPT], ONE_TOKEN),
        "after_update": lambda: (llm.update_weights(fresh), llm.generate([PROMPT], ONE_TOKEN)),
    }, args.repeats)
    row.update({f"first_token_{kind}_s": round(seconds, 4) for kind, seconds in first_token.items()})
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="embedded,llama-135m-30l")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--updates", type=int, default=100)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "weight_update_cpu.json"))
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        os.environ["RIDGELINE_COMPILATION_CACHE_DIR"] = os.path.join(d, "cache", "jax")  # conversions beside it
        for name in args.models.split(","):
            if name == "embedded":
                rows.append(measure(name, default_checkpoint_dir(), args))
            else:
                rows.append(measure(name, startup.write_135m_checkpoint(d, convert=False)[0], args))
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "devices": len(jax.devices()), "rows": rows}
    startup.save(args.out, result)
    return result


if __name__ == "__main__":
    main()
