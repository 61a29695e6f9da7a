"""`python -m serving.aot`: compile the server's step programs for a GPU mesh on a machine without a GPU.

With the `jax[cuda12]` plugin installed (`pip install -e '.[cuda12]'`), XLA's GPU compiler runs on the
CPU: abstract devices described by a `GpuTargetConfig` (`serving.gpu_targets`) stand in for the GPUs,
every argument is a `jax.ShapeDtypeStruct` sharded over a mesh of them, and `jit(...).lower(...).compile()`
goes all the way to PTX. No weight is read and nothing is allocated, so a 70B layout compiles here.

    python -m serving.aot --model llama3-8b --device h100-sxm --buckets minimal --format json

For the device's memory at `--kv_cache_memory_fraction`, the KV pool is sized as the server sizes it
(`serving.core.kv_pool.default_num_pages`: the fraction of the device less the weights, at most
`max_num_seqs` full-length sequences), the bucket plan follows from it (`Buckets`, as the engine builds
it), and each bucket's step program (`model_runner._step_jit`, the program the runner compiles) is
compiled, with the page copy and the KV zeroing. For each program it reports XLA's per-device memory
analysis, the Pallas kernels in the PTX with `ptxas -v`'s registers, spills and shared memory, the
collectives of the compiled HLO with their bytes, and a roofline time from the step's bytes and flops
counted from the model's shape against the device's bandwidth and peak.

Bad input (unknown device, a tensor-parallel size that does not divide the heads, a layout that does not
fit) prints one `error: ...` line and exits with status 2. A program that fails to compile reports its
error in its own entry.
"""

from __future__ import annotations

import os

# A compile-only process: the CPU stays the default backend and the plugin does not look for a driver.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from serving.gpu_targets import GPU_TARGETS, GpuTarget, get_target  # noqa: E402

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
EXTRA_HINT = "pip install -e '.[cuda12]'"


class AotError(Exception):
    """Bad input: reported as one `error:` line, exit status 2."""


# --------------------------------------------------------------------------- inputs

def load_config(model: str | None, checkpoint: str | None):
    """The model config of a preset name (`configs/<name>.json`), a JSON file, or a checkpoint directory."""
    from model.config import LlamaConfig

    if checkpoint:
        path = os.path.join(checkpoint, "config.json") if os.path.isdir(checkpoint) else checkpoint
    elif model and os.path.exists(model):
        path = model
    else:
        name = model or "llama3-8b"
        path = os.path.join(CONFIG_DIR, name.removesuffix(".json") + ".json")
        if not os.path.exists(path):
            presets = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json") and "rules" not in f)
            raise AotError(f"unknown model {name!r}; presets: {', '.join(presets)} (or a config.json path)")
    if not os.path.exists(path):
        raise AotError(f"no model config at {path}")
    return LlamaConfig.load(path)


def plugin_available() -> bool:
    """Whether the CUDA plugin that compiles for GPUs is importable."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_mesh(target: GpuTarget, tp: int, num_hosts: int):
    """A mesh of `tp` abstract devices of `target` over `num_hosts` hosts, tensor axis over all of them."""
    from jax.experimental import topologies

    from sharding.mesh import make_mesh

    if tp % num_hosts:
        raise AotError(f"--tensor_parallel_size {tp} does not split over --num_hosts {num_hosts}")
    topo = topologies.get_topology_desc("aot", "cuda", target_config=target.target_config(),
                                        topology=f"1x{num_hosts}x{tp // num_hosts}")
    return make_mesh(tensor=tp, devices=list(topo.devices))


def check_divides(cfg, tp: int) -> None:
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("experts", getattr(cfg, "num_experts", None) or tp)):
        if n % tp and not (what == "KV heads" and tp % n == 0):
            raise AotError(f"--tensor_parallel_size {tp} does not divide the model's {n} {what}")


def _sds(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _bytes_per_device(tree) -> int:
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def abstract_params(cfg, layout, scan: bool):
    """The weights as sharded ShapeDtypeStructs, stacked over layers when the step scans them (as the runner
    places them on a GPU)."""
    import dataclasses

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from model.params import abstract_params as declared

    params = declared(cfg, layout.param_shardings(cfg))
    if not scan:
        return params
    first = params.layers[0]
    stacked = jax.tree.map(lambda x: _sds((len(params.layers),) + x.shape, x.dtype,
                                          NamedSharding(x.sharding.mesh, PartitionSpec(None, *x.sharding.spec))),
                           first)
    return dataclasses.replace(params, layers=stacked)


def abstract_cache(cfg, layout, num_pages: int, page_size: int, dtype, scan: bool):
    import jax

    from model.cache import KVCache, StackedKVCache
    from model.params import is_array_info

    shardings = layout.cache_shardings(cfg, num_pages, page_size, dtype)
    if scan:
        decl = StackedKVCache.declare(cfg, num_pages, page_size, dtype)
        shardings = StackedKVCache(shardings.k[0], shardings.v[0], cfg.num_layers)
    else:
        decl = KVCache.declare(cfg, num_pages, page_size, dtype)
    return jax.tree.map(lambda i, s: _sds(i.shape, i.dtype, s), decl, shardings, is_leaf=is_array_info)


# --------------------------------------------------------------------------- reading the compiled program

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (`bf16[8,4096]{1,0}` or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
    return int(total)


_HLO_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8", "uint8": "u8", "int32": "s32",
               "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "bool": "pred"}


def hlo_shape(dtype, dims) -> str:
    import numpy as np

    name = np.dtype(dtype).name
    return f"{_HLO_DTYPES.get(name, name)}[{','.join(str(d) for d in dims)}]"


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape `(a, (b, c), ...)`."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(shape[start:i].strip())
            start = i + 1
    return parts


def collectives_with_bytes(hlo: str) -> dict:
    """{kind: {"count", "bytes"}} of the compiled HLO's collectives (async pairs once, as their start)."""
    from sharding.hlo import collectives

    out: dict = {}
    for c in collectives(hlo):
        entry = out.setdefault(c["kind"], {"count": 0, "bytes": 0})
        entry["count"] += 1
        shape = c["shape"]
        if shape.startswith("(") and c["kind"] != "all-reduce":  # an async start's (operands, results, ...)
            shape = _tuple_elements(shape)[1]
        entry["bytes"] += shape_bytes(shape)  # an all-reduce's shape is its results'
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_NOT_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
                "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done", "all-reduce-done",
                "all-gather-done", "collective-permute-done", "send-done", "recv-done", "async-done"}


def _closing(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _instructions(body: str):
    """(name, shape, opcode, operand names, line) of each instruction of one computation's text."""
    for line in body.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        rest = line[m.end():]
        end = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
        shape, rest = rest[:end], rest[end:].lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        args = rest[op.end() - 1:_closing(rest, op.end() - 1)]
        yield m.group(1), shape, op.group(1), re.findall(r"%([\w.\-]+)", args), line


def hlo_traffic(hlo: str, skip_shapes=()) -> int:
    """Bytes the compiled program's kernels read and write: each top-level instruction's operands and result
    (the entry computation, and while bodies times their known trip count), leaving out buffers of the shapes
    in `skip_shapes` (the KV page arrays, which the kernels address through page tables and update in place)."""
    skip = {m for s in skip_shapes for m in _ARRAY.findall(s)}
    comps = {}
    for m in re.finditer(r"^(ENTRY\s+)?%([\w.\-]+)\s.*?\{\n(.*?)^\}", hlo, re.M | re.S):
        comps[m.group(2)] = (bool(m.group(1)), m.group(3))
    entry = next((name for name, (is_entry, _) in comps.items() if is_entry), None)
    total, todo, seen = 0, [(entry, 1)], set()
    while todo:
        name, times = todo.pop()
        if name not in comps or name in seen:
            continue
        seen.add(name)
        shapes = {}
        for inst, shape, opcode, operands, line in _instructions(comps[name][1]):
            shapes[inst] = shape
            if opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                body = re.search(r"body=%([\w.\-]+)", line)
                if body:
                    todo.append((body.group(1), times * (int(trips.group(1)) if trips else 1)))
            if opcode in _NOT_TRAFFIC:
                continue
            for part in [shape] + [shapes.get(o, "") for o in operands]:
                for dtype, dims in _ARRAY.findall(part):
                    if (dtype, dims) not in skip:
                        total += times * shape_bytes(f"{dtype}[{dims}]")
    return total


def ptxas_path() -> str | None:
    try:
        import nvidia.cuda_nvcc
    except ImportError:
        return None
    for root in nvidia.cuda_nvcc.__path__:
        path = os.path.join(root, "bin", "ptxas")
        if os.path.exists(path):
            return path
    return None


_ENTRY = re.compile(r"\.visible\s+\.entry\s+([\w$]+)\s*\(")
_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def ptxas_report(ptx_file: str, arch: str) -> dict:
    """{entry: {"registers", "spill_bytes", "shared_bytes"}} from `ptxas -v` over one PTX file."""
    ptxas = ptxas_path()
    if ptxas is None:
        return {}
    proc = subprocess.run([ptxas, "-v", f"-arch={arch}", ptx_file, "-o", os.devnull], capture_output=True,
                          text=True, timeout=300)
    found, name = {}, None
    for line in (proc.stderr + proc.stdout).splitlines():
        if m := _FUNC.search(line):
            name = m.group(1)
            found[name] = {"registers": 0, "spill_bytes": 0, "shared_bytes": 0}
        elif name and (m := _SPILL.search(line)):
            found[name]["spill_bytes"] = int(m.group(2)) + int(m.group(3))
        elif name and (m := _USED.search(line)):
            found[name]["registers"] = int(m.group(1))
            found[name]["shared_bytes"] = int(m.group(2) or 0)
    return found


_PALLAS_OP = re.compile(r'op_name="[^"]*?/([\w.-]+)/pallas_call')


def pallas_kernel_names(hlo: str) -> list[str]:
    """Names of the Pallas kernels the compiled HLO calls (Triton and Mosaic GPU custom calls, named by the
    scope of their `pallas_call`)."""
    names = set()
    for line in hlo.splitlines():
        if "custom-call(" in line and ("__gpu$xla.gpu.triton" in line or "mosaic_gpu" in line):
            m = _PALLAS_OP.search(line)
            if m:
                names.add(m.group(1))
    return sorted(names)


def kernels(dump_dir: str, hlo: str, target: GpuTarget) -> list[dict]:
    """The Pallas kernels of one compiled program with ptxas's figures (spills and shared memory over the
    device's opt-in limit flagged)."""
    wanted = pallas_kernel_names(hlo)
    found: dict = {}
    for ptx in sorted(glob.glob(os.path.join(dump_dir, "**", "*.ptx"), recursive=True)):
        with open(ptx) as f:
            text = f.read()
        entries = _ENTRY.findall(text)
        if not any(any(w in e for w in wanted) for e in entries):
            continue
        arch = re.search(r"^\.target\s+(\w+)", text, re.M)  # sm_90a for Hopper's Triton kernels
        for entry, figures in ptxas_report(ptx, arch.group(1) if arch else target.sm_arch).items():
            if any(w in entry for w in wanted):
                # Triton kernels take their shared memory at launch (`.extern .shared`): ptxas counts only the
                # static part, so the entry says when a dynamic part exists.
                found[entry] = dict(figures, dynamic_shared=".extern .shared" in text)
    out = []
    for entry, f in sorted(found.items()):
        out.append({"name": entry, **f, "spills": f["spill_bytes"] > 0,
                    "shared_over_limit": f["shared_bytes"] > target.shared_per_block_optin})
    for name in wanted:  # a kernel in the HLO whose PTX was not found still shows, without figures
        if not any(name in e["name"] for e in out):
            out.append({"name": name, "registers": None, "spill_bytes": None, "shared_bytes": None})
    return out


# --------------------------------------------------------------------------- the model's bytes and flops

def step_roofline(cfg, shape, *, tp: int, weights_bytes: int, param_count: int, kv_bytes_per_token_dev: float,
                  page_size: int, target: GpuTarget, collective_bytes: int, context_len: int) -> dict:
    """Bytes and flops of one step counted from the model's shape (per device), and the time the device's
    bandwidth and peak allow: the larger of the two, plus the collectives over the interconnect."""
    d, L = cfg.head_dim, cfg.num_layers
    embed = cfg.vocab_size * cfg.hidden_size
    matmul_params = param_count - embed * (1 if cfg.tie_word_embeddings else 2)  # the embedding is a gather
    context = min(shape.P * page_size, context_len)  # tokens each sequence's attention reads
    flops = (2 * shape.T * max(matmul_params, 0) + 2 * shape.S * embed
             + 4 * shape.T * min(context, cfg.max_position_embeddings) * cfg.num_heads * d * L) / tp
    kv_read = shape.S * context * kv_bytes_per_token_dev if shape.T <= shape.S else shape.T * kv_bytes_per_token_dev
    moved = weights_bytes + kv_read + shape.T * kv_bytes_per_token_dev
    t_mem, t_flop = moved / target.memory_bandwidth, flops / target.bf16_flops
    t = max(t_mem, t_flop) + collective_bytes / target.interconnect_bandwidth
    return {"context_len": context, "ideal_bytes": int(moved), "flops": int(flops), "roofline_s": t,
            "mbu_ceiling": t_mem / t if t else 0.0}


# --------------------------------------------------------------------------- compiling

def compile_program(name: str, jitted, args, kwargs, target: GpuTarget) -> tuple[dict, str | None]:
    """Compiles one program; returns its entry and the compiled HLO text (None when it did not compile)."""
    with tempfile.TemporaryDirectory(prefix="ridgeline-aot-") as dump:
        start = time.perf_counter()
        try:
            lowered = jitted.lower(*args, **kwargs)
            compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_gpu_autotune_level": 0})
        except Exception as e:  # the run goes on with the other programs
            return {"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:500]}"}, None
        seconds = time.perf_counter() - start
        hlo = compiled.as_text()
        mem = compiled.memory_analysis()
        entry = {"name": name, "compile_s": round(seconds, 2)}
        for field in ("argument", "output", "temp", "alias", "generated_code"):
            entry[f"{field}_bytes"] = int(getattr(mem, f"{field}_size_in_bytes", 0)) if mem is not None else None
        entry["kernels"] = kernels(dump, hlo, target)
        entry["collectives"] = collectives_with_bytes(hlo)
    return entry, hlo


# serving.aot's device names where sharding.hardware spells them otherwise.
_PLANNER_DEVICE = {"a100-80g": "a100-80gb"}


def planner_vs_xla(cfg, args, entry: dict, *, kv_pool_tokens: int) -> dict:
    """`sharding.estimate.step_memory` for this program's layout beside XLA's memory analysis of it:
    the planner's weights + KV pool + activations against XLA's arguments + temporaries per device."""
    from sharding.estimate import DTYPE_BYTES, PlanInputs, step_memory
    from sharding.hardware import get_gpu

    kv = None if args.kv_cache_dtype in (None, "auto") else args.kv_cache_dtype
    inp = PlanInputs(cfg=cfg, gpu=get_gpu(_PLANNER_DEVICE.get(args.device, args.device)),
                     tp=args.tensor_parallel_size, context_len=args.context_len,
                     kv_dtype=kv if kv in DTYPE_BYTES else None, reserve_bytes=0.0)
    predicted = step_memory(inp, tokens=entry["tokens"], sequences=entry["sequences"], kv_pool_tokens=kv_pool_tokens)
    xla = entry["argument_bytes"] + entry["temp_bytes"]
    return {**predicted, "xla_bytes": xla, "ratio": round(predicted["total_bytes"] / xla, 4),
            "activation_ratio": round(predicted["activation_bytes"] / max(entry["temp_bytes"], 1), 3)}


def plan(cfg, args, layout, target: GpuTarget) -> dict:
    """The engine's sizing for the device: weights and page bytes per device, the KV pool, the buckets."""
    import jax

    from model.quant import kv_cache_dtype
    from serving.core.input_batch import Buckets

    cache_dtype = kv_cache_dtype(cfg, args.kv_cache_dtype)
    params = abstract_params(cfg, layout, scan=False)
    weights = _bytes_per_device(params)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    probe = 64
    page_bytes = layout.cache_bytes_per_device(cfg, probe, args.page_size, cache_dtype) / probe
    # What the server's pool sizing sees as the device's `bytes_limit`: the share of memory jax's allocator
    # takes (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set).
    limit = target.memory_bytes * args.client_mem_fraction
    budget = limit * args.kv_cache_memory_fraction - weights
    if budget < page_bytes:
        raise AotError(f"the weights take {weights / 1e9:.2f} GB per device, over the "
                       f"{limit * args.kv_cache_memory_fraction / 1e9:.2f} GB that --kv_cache_memory_fraction "
                       f"{args.kv_cache_memory_fraction} of the allocator's {limit / 1e9:.1f} GB of the {target.name} "
                       f"({target.memory_bytes / 1e9:.0f} GB) allows: does not fit; raise --tensor_parallel_size")
    model_len = args.max_model_len or cfg.max_position_embeddings
    wanted = args.max_num_seqs * -(-model_len // args.page_size)
    num_pages = max(1, min(wanted, int(budget // page_bytes)))
    if model_len > num_pages * args.page_size:
        if args.max_model_len:
            raise AotError(f"--max_model_len {model_len} needs {-(-model_len // args.page_size)} pages but the KV "
                           f"pool that fits has {num_pages}")
        model_len = num_pages * args.page_size
    buckets = Buckets(args.max_num_batched_tokens, args.max_num_seqs, -(-model_len // args.page_size),
                      1, -(-64 // args.page_size), decode_step=8)
    return {"cache_dtype": cache_dtype, "weights_bytes": weights, "param_count": count, "page_bytes": page_bytes,
            "num_pages": num_pages,
            "max_model_len": model_len, "buckets": buckets}


def chosen_shapes(buckets, which: str) -> list:
    from serving.core.input_batch import StepShape

    every = sorted((StepShape(T, S, P) for T, S, P in buckets.all_shapes()), key=lambda s: (s.T, s.P))
    if which == "all":
        return every
    if which == "minimal":  # the batch-1 decode, the full decode, the largest bucket (holds every step)
        full_decode = [s for s in every if s.T == buckets.tokens_for(buckets.max_num_seqs)]
        picks = [every[0]] + full_decode[-1:] + [every[-1]]
        return list(dict.fromkeys(picks))
    picks = []
    for item in which.split(","):
        try:
            T, S, P = (int(v) for v in item.split(":"))
        except ValueError:
            raise AotError(f"--buckets takes all, minimal or T:S:P[,T:S:P...], got {item!r}") from None
        picks.append(StepShape(T, S, P))
    return picks


def logit_parts(cfg, max_num_seqs: int = None) -> tuple:
    """The step parts with device inputs that a server of `cfg` built with default options (and
    `max_num_seqs`, where given) compiles into every step: sampling controls' slots and state, structured
    outputs' token bitmask (`serving.features.build_parts`)."""
    from serving.core import engine_args, step_parts
    from serving.features import build_parts

    options = {o.name: o.default for o in engine_args.OPTIONS}
    if max_num_seqs is not None:
        options["max_num_seqs"] = max_num_seqs
    return step_parts.logit_parts(p for p in build_parts(options, cfg) if isinstance(p, step_parts.StepPart))


def run(args) -> dict:
    try:
        target = get_target(args.device)
    except ValueError as e:
        raise AotError(str(e)) from None
    if args.pipeline_parallel_size != 1:
        raise AotError(f"--pipeline_parallel_size {args.pipeline_parallel_size}: pipeline stages are not compiled "
                       "by serving.aot yet (tensor parallelism only)")
    cfg = load_config(args.model, args.checkpoint)
    if args.quantization not in (None, "none"):  # the weight kinds of `--weight_dtype` / a quantized checkpoint
        from model.quant import check_weight_dtype

        try:
            cfg = cfg.replace(weight_dtype=check_weight_dtype(args.quantization))
        except ValueError as e:
            raise AotError(f"--quantization {args.quantization}: {e}") from None
    if args.dtype != "auto":
        cfg = cfg.replace(dtype=args.dtype)
    tp = args.tensor_parallel_size
    if tp < 1:
        raise AotError(f"--tensor_parallel_size must be >= 1, got {tp}")
    check_divides(cfg, tp)
    if not plugin_available():
        raise AotError(f"compiling for a GPU needs the jax[cuda12] plugin: {EXTRA_HINT}")

    import jax
    import numpy as np
    from kernels_pallas import pallas_supports_head_dim
    from model.cache import cache_builder
    from serving.core import model_runner, step_parts
    from sharding.layout import Layout

    layout = Layout.create(gpu_mesh(target, tp, args.num_hosts), "megatron")
    sizing = plan(cfg, args, layout, target)
    backend = args.attention_backend
    if backend == "auto":
        backend = "pallas" if pallas_supports_head_dim(cfg.head_dim) else "xla"
    scan = args.layer_loop != "unroll"
    params = abstract_params(cfg, layout, scan)
    num_pages, ps, buckets = sizing["num_pages"], args.page_size, sizing["buckets"]
    cache = abstract_cache(cfg, layout, num_pages, ps, sizing["cache_dtype"], scan)
    kv_pool = _bytes_per_device(cache)
    rep = layout.replicated
    abstract = lambda tree: jax.tree.map(lambda x: _sds(np.shape(x), x.dtype, rep), tree)  # noqa: E731
    feed = _sds((buckets.max_num_seqs,), np.int32, rep)
    kv_per_token = kv_pool / (num_pages * ps)
    page_shapes = [hlo_shape(x.dtype, x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(cache)]

    parts = logit_parts(cfg, args.max_num_seqs)
    states = tuple(None if (state := p.step_state()) is None else abstract(state) for p in parts)
    programs = []
    for shape in chosen_shapes(buckets, args.buckets):
        (_, isize), (_, fsize) = shape.offsets(shape.int_fields), shape.offsets(shape.float_fields)
        step_args = (params, cache, _sds((isize,), np.int32, rep), _sds((fsize,), np.float32, rep), feed, states,
                     None, (), step_parts.input_specs(parts, shape.S, rep))  # no device input, no weight states
        kind = "decode" if shape.T <= buckets.max_num_seqs else "prefill"
        name = f"{kind} T={shape.T} S={shape.S} P={shape.P}"
        entry, hlo = compile_program(name, model_runner._step_jit, step_args,
                                     dict(cfg=cfg, backend=backend, shape=shape, layout=layout, logit_parts=parts), target)
        entry.update(kind=kind, tokens=shape.T, sequences=shape.S, pages=shape.P)
        if "error" not in entry:
            coll = sum(c["bytes"] for c in entry["collectives"].values())
            entry.update(step_roofline(cfg, shape, tp=tp, weights_bytes=sizing["weights_bytes"],
                                       param_count=sizing["param_count"],
                                       kv_bytes_per_token_dev=kv_per_token, page_size=ps, target=target,
                                       collective_bytes=coll, context_len=args.context_len))
            # The kernels' KV traffic at the ideal (the page arrays are addressed through page tables), the rest
            # as the compiled HLO moves it.
            kv = entry["ideal_bytes"] - sizing["weights_bytes"]
            entry["hlo_bytes"] = hlo_traffic(hlo, page_shapes) + int(kv)
            entry["traffic_ratio"] = round(entry["hlo_bytes"] / entry["ideal_bytes"], 3)
            entry["planner"] = planner_vs_xla(cfg, args, entry, kv_pool_tokens=num_pages * ps)
        programs.append(entry)
    if not args.skip_small_programs:
        pairs = _sds((buckets.max_num_seqs,), np.int32, rep)
        entry, _ = compile_program("copy-pages", model_runner._copy_jit, (cache, pairs, pairs), {}, target)
        programs.append(entry)
        shardings = jax.tree.map(lambda x: x.sharding, cache)
        build = cache_builder(cfg, num_pages, ps, sizing["cache_dtype"], shardings, scan)
        entry, _ = compile_program("init-cache", build, (), {}, target)
        programs.append(entry)
    temps = [p["temp_bytes"] or 0 for p in programs if "error" not in p]
    memory = sizing["weights_bytes"] + kv_pool + max(temps, default=0)
    return {
        "device": args.device, "device_name": target.name, "num_devices": tp,
        "mesh": {k: int(v) for k, v in layout.mesh.shape.items()}, "num_hosts": args.num_hosts,
        "model": args.checkpoint or args.model, "attention_backend": backend,
        "layer_loop": "scan" if scan else "unroll",
        "weights_bytes": sizing["weights_bytes"], "kv_pool_bytes": kv_pool, "num_pages": num_pages,
        "page_size": ps, "kv_pool_tokens": num_pages * ps, "max_model_len": sizing["max_model_len"],
        "memory_bytes": memory, "device_memory_bytes": target.memory_bytes,
        "fits": memory <= target.memory_bytes * args.client_mem_fraction,
        "client_mem_fraction": args.client_mem_fraction,
        "buckets_total": len(buckets.all_shapes()),
        "programs": programs,
    }


# --------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m serving.aot", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="preset name under configs/ (llama3-8b, llama3-70b, ...) or a "
                   "config.json path; default llama3-8b")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory: only its config.json is read")
    p.add_argument("--device", default="h100-sxm", help=f"one of {', '.join(GPU_TARGETS)}")
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    p.add_argument("--pipeline_parallel_size", type=int, default=1)
    p.add_argument("--num_hosts", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv_cache_dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv_cache_memory_fraction", type=float, default=0.9)
    p.add_argument("--client_mem_fraction", type=float,
                   default=float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75)),
                   help="share of device memory jax's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION; jax's "
                   "default 0.75): the bytes_limit the server sizes its KV pool from")
    p.add_argument("--max_num_seqs", type=int, default=64)
    p.add_argument("--max_num_batched_tokens", type=int, default=512)
    p.add_argument("--max_model_len", type=int, default=None)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--context_len", type=int, default=2048, help="tokens of KV each sequence reads in the roofline "
                   "(at most its bucket's pages)")
    p.add_argument("--attention_backend", default="auto", help="auto (pallas where it takes the head size), pallas, "
                   "xla, reference")
    p.add_argument("--layer_loop", default="auto", choices=("auto", "scan", "unroll"))
    p.add_argument("--buckets", default="all", help="all (every bucket of the plan), minimal (batch-1 decode, full "
                   "decode, largest bucket) or T:S:P[,T:S:P...]")
    p.add_argument("--skip_small_programs", action="store_true", help="compile only the step buckets")
    p.add_argument("--format", default="text", choices=("text", "json"))
    return p.parse_args(argv)


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def format_text(report: dict) -> str:
    lines = [f"{report['device_name']} x{report['num_devices']} mesh {report['mesh']}  model {report['model']}  "
             f"backend {report['attention_backend']}",
             f"weights {_gb(report['weights_bytes'])} GB/device  KV pool {_gb(report['kv_pool_bytes'])} GB "
             f"({report['num_pages']} pages, {report['kv_pool_tokens']} tokens)  total with largest temp "
             f"{_gb(report['memory_bytes'])} GB of {_gb(report['device_memory_bytes'])}: "
             f"{'fits' if report['fits'] else 'DOES NOT FIT'}",
             f"{'program':<28}{'compile s':>10}{'arg GB':>8}{'out GB':>8}{'temp GB':>9}{'roofline ms':>13}"
             f"{'MBU':>6}{'traffic':>8}  kernels / collectives"]
    for p in report["programs"]:
        if "error" in p:
            lines.append(f"{p['name']:<28}  error: {p['error']}")
            continue
        ks = ", ".join(f"{k['name']} {k['registers']} regs {k['spill_bytes']} B spill {k['shared_bytes']} B smem"
                       for k in p["kernels"])
        cs = ", ".join(f"{k} x{v['count']} {v['bytes']} B" for k, v in p["collectives"].items())
        roof = f"{p['roofline_s'] * 1e3:>13.3f}{p['mbu_ceiling']:>6.2f}{p['traffic_ratio']:>8.2f}" \
            if "roofline_s" in p else " " * 27
        lines.append(f"{p['name']:<28}{p['compile_s']:>10.1f}{_gb(p['argument_bytes']):>8}{_gb(p['output_bytes']):>8}"
                     f"{_gb(p['temp_bytes']):>9}{roof}  {ks or '-'} / {cs or '-'}")
    planned = [p for p in report["programs"] if "planner" in p]
    if planned:
        lines.append(f"{'planner vs XLA, GB/device':<28}{'weights':>10}{'KV':>8}{'act':>9}{'total':>8}{'XLA':>8}"
                     f"{'ratio':>7}")
        for p in planned:
            e = p["planner"]
            lines.append(f"{p['name']:<28}{_gb(e['weights_bytes']):>10}{_gb(e['kv_pool_bytes']):>8}"
                         f"{_gb(e['activation_bytes']):>9}{_gb(e['total_bytes']):>8}{_gb(e['xla_bytes']):>8}"
                         f"{e['ratio']:>7.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except AotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.format == "json" else format_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
