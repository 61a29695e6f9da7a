"""Image requests on the engine: throughput and time to first token with the encoder cache cold and
warm, and where the time goes (preprocessing, encoding, language model).

    python benchmarks/vision_bench.py                     # 16 requests, 224x224 images, ~20 s on a 2-core CPU
    python benchmarks/vision_bench.py --requests 32 --image_size 448
    python benchmarks/vision_bench.py --family gemma3       # Gemma 3 multimodal (fixed 224x224 input, 64 soft tokens)
    python benchmarks/vision_bench.py --encoder_only --out benchmarks/results/vision_encoder_padding_cpu.json

A random Qwen2.5-VL-shaped model (or, with `--family gemma3`, a Gemma 3 multimodal-shaped one: a
SigLIP encoder over a fixed 224 x 224 image pooled to 64 soft tokens that the decoder attends both ways;
`model.params.init_params`; no download) is served by `LLM` with its
step buckets warmed up and a first batch of other images run beforehand (the encoder compiled for the
image size, every step shape run once), so no compile or first run lands in the numbers. Each run
submits every request at once (an offline batch: all are made, i.e. preprocessed and encoded, then
stepped to completion, as `LLM.generate` does):

* `cold`: distinct images never seen (every image preprocessed and encoded);
* `warm`: the same images again, the encoder cache holding them (only the content digest is computed),
  the prefix cache reset first, so the language model does the same prefill work as in `cold`;
* `text` (the peer): prompts of the same token count with no image, for the language model alone.

Each kind runs `--repeats` times (new images for each cold run) and the fastest is recorded.

`encoder_padding`: the encoder alone on images of `--encoder_sizes`, padded to its bucket
(`model.vision.encoder_buckets`, what the engine runs) against the exact encoder (one program per
grid), both compiled beforehand, fastest of `--repeats` each; the same-run ratio padded / exact is what
padding costs (at most a doubling of the patches, nothing for an image whose patch count is a bucket).
Recorded per run: requests/s and output tokens/s, TTFT p50 / max (submission to first token, the
encoding included), and the seconds in preprocessing, encoding and the language model (the rest of
the wall time), with their shares; and the same-run ratios warm / cold and cold / text.

Writes benchmarks/results/vision_bench_cpu.json (Gemma 3: vision_bench_gemma3_cpu.json; or `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.config import LlamaConfig  # noqa: E402
from model.params import init_params  # noqa: E402
from model.families.gemma3_vl import config_from_hf as gemma3_config  # noqa: E402
from model.vision import encoder  # noqa: E402
from model.vision.config import QWEN2_5_VL, VisionConfig  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.features.multimodal import Multimodal  # noqa: E402
from model.vision import encoder_buckets  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
IMAGE, START, END = 1000, 1001, 1002


def model_config() -> LlamaConfig:
    vision = VisionConfig(kind=QWEN2_5_VL, depth=4, hidden_size=128, intermediate_size=256, num_heads=4,
                          out_hidden_size=256, fullatt_block_indexes=(1, 3), image_prompt_ids=(START, IMAGE, END))
    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64, rope_theta=1e6, dtype="float32", max_position_embeddings=2048,
                       architecture="Qwen2_5_VLForConditionalGeneration", attention_bias=True, vision=vision,
                       image_token_id=IMAGE, mrope_section=(8, 12, 12))


def gemma3_model_config() -> LlamaConfig:
    """Gemma 3 multimodal's structure at the Qwen-shaped model's size: its decoder (q/k norms, sandwich
    norms, sliding and global layers) and a SigLIP encoder over 224 x 224 images (16 x 16 patches of 14,
    pooled 2 x 2 to 64 soft tokens)."""
    return gemma3_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "image_token_index": IMAGE, "boi_token_index": START,
        "eoi_token_index": END, "mm_tokens_per_image": 64, "dtype": "float32",
        "text_config": {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                        "max_position_embeddings": 2048, "sliding_window": 128, "query_pre_attn_scalar": 64,
                        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                                        "full_attention"]},
        "vision_config": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                          "num_attention_heads": 4, "image_size": 224, "patch_size": 14}})


FAMILIES = {
    "qwen2_5_vl": (model_config, {"text": "4 layers, hidden 256, 4 heads / 2 kv, head_dim 64, fp32",
                                  "vision": "4 blocks (2 full-attention), hidden 128, 4 heads, fp32"}),
    "gemma3": (gemma3_model_config, {"text": "Gemma 3: 4 layers (3 sliding, window 128), hidden 256, 4 heads / 2 kv, "
                                             "head_dim 64, fp32",
                                     "vision": "SigLIP: 4 blocks, hidden 128, 4 heads, 224x224 -> 64 soft tokens, fp32"}),
}


def make_images(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def run(llm, prompts, sp, label: str) -> dict:
    engine = llm.engine
    mm = engine.part(Multimodal)
    before = dict(mm.seconds)
    t0 = time.monotonic()
    reqs = [engine.make_request(f"{label}-{i}", p, sp, arrival_time=t0) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.enqueue(r)
    done = {}
    while len(done) < len(reqs):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    wall = time.monotonic() - t0
    ttft = np.array([r.metrics.first_token_time - t0 for r in reqs])
    out_tokens = sum(len(o.outputs[0].token_ids) for o in done.values())
    pre = mm.seconds["preprocess"] - before["preprocess"]
    enc = mm.seconds["encode"] - before["encode"]
    lm = wall - pre - enc
    return {"requests": len(reqs), "prompt_tokens": len(reqs[0].prompt_token_ids), "wall_seconds": wall,
            "requests_per_s": len(reqs) / wall, "output_tokens_per_s": out_tokens / wall,
            "ttft_p50_s": float(np.median(ttft)), "ttft_max_s": float(ttft.max()),
            "seconds": {"preprocess": pre, "encode": enc, "language_model": lm},
            "shares": {"preprocess": pre / wall, "encode": enc / wall, "language_model": lm / wall},
            "encoder_cache": {"hits": mm.cache.hits, "misses": mm.cache.misses}}


def encoder_padding(llm, sizes: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Seconds of the padded (bucketed) and the exact encoder per image size, each compiled first."""
    mm, v = llm.engine.part(Multimodal), llm.config.vision
    rng = np.random.default_rng(7)
    out = []
    for h, w in sizes:
        p = encoder.preprocess(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), v)
        times = {}
        for name, fn in (("padded", encoder_buckets.encode), ("exact", encoder.encode)):
            fn(mm.vision_weights, p, v)  # compiles (the exact encoder: this grid's program)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(mm.vision_weights, p, v)
                best = min(best, time.perf_counter() - t0)
            times[name] = best
        out.append({"image": [h, w], "patches": int(p.patches.shape[0]),
                    "bucket": encoder_buckets.bucket_for(p.patches.shape[0], v), "padded_s": times["padded"],
                    "exact_s": times["exact"], "padded_over_exact": times["padded"] / times["exact"]})
    return out


def print_padding(padding: list[dict]) -> None:
    for e in padding:
        print(f"encoder {e['image'][0]}x{e['image'][1]}: {e['patches']} patches -> bucket {e['bucket']}: "
              f"padded {e['padded_s'] * 1e3:.1f} ms exact {e['exact_s'] * 1e3:.1f} ms "
              f"(x{e['padded_over_exact']:.2f})")


def record_encoder_padding(args, padding: list[dict]) -> None:
    """`--encoder_only`: prints and records the encoder timing alone."""
    print_padding(padding)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
              "load_average_1_5_15": list(os.getloadavg()),  # the machine is shared: others' load is in the numbers
              "command": "python benchmarks/vision_bench.py " + " ".join(sys.argv[1:]),
              "vision": "4 blocks (2 full-attention), hidden 128, 4 heads, fp32", "repeats": args.repeats,
              "encoder_padding": padding}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", args.out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--image_size", type=int, default=224)
    ap.add_argument("--max_tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each kind; the fastest is recorded")
    ap.add_argument("--encoder_sizes", default="224x224,200x300,300x180,448x336",
                    help="image sizes (HxW) of the padded-vs-exact encoder timing")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl")
    ap.add_argument("--encoder_only", action="store_true", help="only the padded-vs-exact encoder timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out is None:
        name = "vision_bench_cpu.json" if args.family == "qwen2_5_vl" else f"vision_bench_{args.family}_cpu.json"
        args.out = os.path.join(RESULTS, name)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.encoder_sizes.split(",") if s]
    if args.family != "qwen2_5_vl":
        sizes = []  # a fixed-size encoder (Gemma 3's SigLIP) has nothing to pad

    make_config, description = FAMILIES[args.family]
    cfg = make_config()
    params = init_params(cfg, jax.random.PRNGKey(0))
    llm = LLM(config=cfg, params=params, max_num_seqs=16, max_num_batched_tokens=256, page_size=16,
              num_pages=512, max_model_len=512, min_token_bucket=16, warmup=not args.encoder_only)
    if args.encoder_only:
        return record_encoder_padding(args, encoder_padding(llm, sizes, args.repeats))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    text = [7, 8, 9, 10]

    def image_prompt(image):
        return {"prompt_token_ids": text + [START, IMAGE, END, 11, 12], "multi_modal_data": {"image": image}}

    # A first batch of other images compiles the encoder for this size and runs every step shape once.

    run(llm, [image_prompt(im) for im in make_images(args.requests, args.image_size, 98)], sp, "settle")
    n = run(llm, [image_prompt(im) for im in make_images(1, args.image_size, 97)], sp, "len")["prompt_tokens"]
    rng = np.random.default_rng(1)
    cold = warm = peer = None
    best = lambda a, b: b if a is None or b["requests_per_s"] > a["requests_per_s"] else a  # noqa: E731
    for rep in range(args.repeats):  # best of: the machine is shared, the slow runs are the others' load
        images = make_images(args.requests, args.image_size, rep)
        llm.engine.part(Multimodal).cache = type(llm.engine.part(Multimodal).cache)(llm.engine.part(Multimodal).cache.capacity_bytes)
        llm.engine.reset_prefix_cache()
        cold = best(cold, run(llm, [image_prompt(im) for im in images], sp, f"cold{rep}"))
        llm.engine.reset_prefix_cache()
        warm = best(warm, run(llm, [image_prompt(im) for im in images], sp, f"warm{rep}"))
        llm.engine.reset_prefix_cache()
        peer = best(peer, run(llm, [rng.integers(20, 900, n).tolist() for _ in range(args.requests)], sp,
                              f"text{rep}"))
    ratios = {"warm_over_cold_requests_per_s": warm["requests_per_s"] / cold["requests_per_s"],
              "cold_ttft_p50_over_warm": cold["ttft_p50_s"] / warm["ttft_p50_s"],
              "cold_over_text_requests_per_s": cold["requests_per_s"] / peer["requests_per_s"],
              "warm_over_text_requests_per_s": warm["requests_per_s"] / peer["requests_per_s"]}
    for name, r in (("cold", cold), ("warm", warm), ("text", peer)):
        s = r["shares"]
        print(f"{name:5s} {r['requests_per_s']:6.2f} req/s {r['output_tokens_per_s']:7.1f} tok/s  "
              f"TTFT p50 {r['ttft_p50_s']:.3f} s max {r['ttft_max_s']:.3f} s  "
              f"preprocess {s['preprocess']:.0%} encode {s['encode']:.0%} LM {s['language_model']:.0%}")
    print("ratios:", {k: round(v, 2) for k, v in ratios.items()})
    padding = encoder_padding(llm, sizes, args.repeats)
    print_padding(padding)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
              "load_average_1_5_15": list(os.getloadavg()),  # the machine is shared: others' load is in the numbers
              "command": "python benchmarks/vision_bench.py " + " ".join(sys.argv[1:]),
              "family": args.family, "model": description,
              "image_size": args.image_size, "image_tokens": cold["prompt_tokens"] - len(text) - 4,
              "max_tokens": args.max_tokens, "cold": cold, "warm": warm, "text_peer": peer, "ratios": ratios,
              "encoder_padding": padding}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
