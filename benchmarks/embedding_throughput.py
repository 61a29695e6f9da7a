"""Embeddings per second on CPU: `LLM.embed` against `SentenceTransformer.encode` on the same checkpoint and inputs.

    python benchmarks/embedding_throughput.py               # ~3 min on 2 cores
    python benchmarks/embedding_throughput.py --inputs 64 --rounds 1

The checkpoint is a decoder embedder of the MiniLM-L6 shape (hidden 384, 6 layers, 12 heads, MLP 1536),
saved with random weights as sentence-transformers saves Qwen3-Embedding: a `Qwen3Model` with last-token
pooling and Normalize (`modules.json`), a byte-level BPE tokenizer. The inputs are `--inputs` texts of
64-256 tokens (random lengths, fixed seed). Both sides embed the same texts in fp32:

* **sentence-transformers**: `SentenceTransformer.encode(texts, batch_size=--st_batch)` (it sorts by
  length and pads each batch), torch on every core;
* **ridgeline**: `LLM.embed(texts)` through the engine's continuous batching (`--max_num_batched_tokens`
  per step, chunked prefill), every step bucket compiled before timing, the prefix cache off (a repeated
  round would otherwise find its texts' pages cached and compute only their last tokens).

Both are bound by the linear layers' FLOPs on a CPU (2 x the linear weights per token, printed as GFLOP/s):
the ratio says how close each gets to the cores' matmul rate, and how much padding each computes.

Both embed the whole list `--rounds` times, alternating, best kept; the ratio is texts per second, ours
over sentence-transformers'. Embeddings are checked equal (cosine distance) before timing. Writes
benchmarks/results/embedding_throughput_cpu.json (or `--out`).

The issue's MiniLM-L6 is a BERT encoder, which the engine does not run (docs/pooling.md, "What is not
built"); this shape is the decoder embedder of the same size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import startup  # noqa: E402
from attention_cpu_bench import best_of_rotating_rounds  # noqa: E402

SHAPE = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12,
             num_key_value_heads=12, head_dim=32, max_position_embeddings=512)
WORDS = ("the quick brown fox jumps over the lazy dog while a naive cafe serves coffee to the capital of "
         "France and def f(x): return x for every token in the corpus").split()


def write_checkpoint(directory: str) -> str:
    """The sentence-transformers directory of a random MiniLM-L6-shaped Qwen3 embedder."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from tests.hf_tokenizer_styles import save_style

    hf_dir, st_dir = os.path.join(directory, "hf"), os.path.join(directory, "st")
    save_style("bytelevel_nobos", hf_dir)
    path = os.path.join(hf_dir, "tokenizer_config.json")
    with open(path) as f:
        conf = json.load(f)
    conf.pop("chat_template", None)
    with open(path, "w") as f:
        json.dump({**conf, "pad_token": "<|endoftext|>"}, f)
    vocab = transformers.AutoTokenizer.from_pretrained(hf_dir).vocab_size + 8
    torch.manual_seed(0)
    model = transformers.Qwen3Model(transformers.Qwen3Config(vocab_size=vocab, **SHAPE)).eval()
    model.save_pretrained(hf_dir)
    st = SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=256), Pooling(384, pooling_mode="lasttoken"),
                                      Normalize()], device="cpu")
    st.save(st_dir)
    return st_dir


def make_texts(tokenizer, n: int, seed: int = 0) -> list[str]:
    """`n` texts of 64-256 tokens under `tokenizer`."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        want = int(rng.integers(64, 257))
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words))) < want:
            words.append(str(rng.choice(WORDS)))
        text = " ".join(words)
        while len(tokenizer.encode(text)) > want:
            text = text[:-1]
        texts.append(text)
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--st_batch", type=int, default=32)
    ap.add_argument("--max_num_seqs", type=int, default=32)
    ap.add_argument("--max_num_batched_tokens", type=int, default=2048)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "embedding_throughput_cpu.json"))
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from serving import LLM

    with tempfile.TemporaryDirectory() as tmp:
        st_dir = write_checkpoint(tmp)
        st = SentenceTransformer(st_dir, device="cpu")
        llm = LLM(model=st_dir, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=512, page_size=16, compilation_cache_dir="", warmup=True, enable_prefix_caching=False)
        texts = make_texts(llm.tokenizer, args.inputs)
        lengths = [len(llm.tokenizer.encode(t)) for t in texts]
        ours = np.stack([o.outputs.data for o in llm.embed(texts)])
        ref = st.encode(texts, batch_size=args.st_batch, convert_to_numpy=True)
        distance = float(np.max(1 - np.sum(ours * ref, -1) / (np.linalg.norm(ours, axis=-1)
                                                                * np.linalg.norm(ref, axis=-1))))
        print(f"{len(texts)} texts, {sum(lengths)} tokens ({min(lengths)}-{max(lengths)} each); max cosine distance "
              f"{distance:.1e}")
        best = best_of_rotating_rounds({
            "sentence_transformers": lambda: st.encode(texts, batch_size=args.st_batch, convert_to_numpy=True),
            "ridgeline": lambda: llm.embed(texts),
        }, args.rounds)
    rate = {name: len(texts) / seconds for name, seconds in best.items()}
    ratio = rate["ridgeline"] / rate["sentence_transformers"]
    h, f, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    flops_per_token = 2 * layers * (4 * h * h + 3 * h * f)  # the linear layers (attention's scores apart)
    gflops = {name: sum(lengths) * flops_per_token / seconds / 1e9 for name, seconds in best.items()}
    for name in best:
        print(f"{name:>22}: {best[name]:.2f} s, {rate[name]:.1f} texts/s, {sum(lengths) / best[name]:.0f} tokens/s, "
              f"{gflops[name]:.0f} GFLOP/s in the linear layers")
    print(f"ridgeline / sentence-transformers: {ratio:.2f}x")
    startup.save(args.out, {
        "benchmark": "embedding_throughput", "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch_threads": torch.get_num_threads(),
        "shape": SHAPE, "inputs": len(texts), "tokens": sum(lengths), "st_batch": args.st_batch,
        "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "max_cosine_distance": distance, "seconds": best, "texts_per_s": rate, "linear_gflops_per_s": gflops,
        "ratio": ratio,
        "command": "python benchmarks/embedding_throughput.py " + " ".join(sys.argv[1:]),
    })


if __name__ == "__main__":
    main()
