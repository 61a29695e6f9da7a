"""Embeddings per second on CPU: `LLM.embed` against `SentenceTransformer.encode` on the same checkpoint and inputs.

    python benchmarks/embedding_throughput.py               # ~5 min on 2 cores: MiniLM-L6 (BERT)
    python benchmarks/embedding_throughput.py --model qwen3 # the decoder embedder of the same size
    python benchmarks/embedding_throughput.py --inputs 64 --rounds 1

The checkpoint has the MiniLM-L6 shape (hidden 384, 6 layers, 12 heads, MLP 1536) with random weights, saved
by sentence-transformers: `--model bert` (default) is all-MiniLM-L6-v2's kind, a `BertModel` (vocabulary
30,522) with mean pooling and Normalize and a WordPiece tokenizer; `--model qwen3` a `Qwen3Model` with
last-token pooling and Normalize (Qwen3-Embedding's kind) and a byte-level BPE tokenizer. The inputs are
`--inputs` texts of 64-256 tokens (random lengths, fixed seed). Both sides embed the same texts in fp32:

* **sentence-transformers**: `SentenceTransformer.encode(texts, batch_size=--st_batch)` (it sorts by
  length and pads each batch), torch on every core;
* **ridgeline**: `LLM.embed(texts)` through the engine's continuous batching (`--max_num_batched_tokens`
  per step, chunked prefill), every step bucket compiled before timing, the prefix cache off (a repeated
  round would otherwise find its texts' pages cached and compute only their last tokens);
* **xla_dense** (bert only): the dense reference `model.families.bert.encoder_forward` jitted over the
  same batches sentence-transformers makes (sorted by length, `--st_batch` each, padded to a multiple of
  32 tokens), then mean pooling and normalization: what XLA on this CPU does without the engine.

Both are bound by the linear layers' FLOPs on a CPU (2 x the linear weights per token, printed as GFLOP/s):
the ratio says how close each gets to the cores' matmul rate, and how much padding each computes.

Both embed the whole list `--rounds` times, alternating, best kept; the ratio is texts per second, ours
over sentence-transformers'. Embeddings are checked equal (cosine distance) before timing. Writes
benchmarks/results/embedding_throughput_<model>_cpu.json (or `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import startup  # noqa: E402
from attention_cpu_bench import best_of_rotating_rounds  # noqa: E402

SHAPE = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12,
             max_position_embeddings=512)
WORDS = ("the quick brown fox jumps over the lazy dog while a naive cafe serves coffee to the capital of "
         "France and def f(x): return x for every token in the corpus").split()


def write_checkpoint(directory: str, model: str = "bert") -> str:
    """The sentence-transformers directory of a random MiniLM-L6-shaped embedder (`model`: bert or qwen3)."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from tests.hf_tokenizer_styles import save_style

    hf_dir, st_dir = os.path.join(directory, "hf"), os.path.join(directory, "st")
    if model == "bert":
        return _write_bert(hf_dir, st_dir)
    save_style("bytelevel_nobos", hf_dir)
    path = os.path.join(hf_dir, "tokenizer_config.json")
    with open(path) as f:
        conf = json.load(f)
    conf.pop("chat_template", None)
    with open(path, "w") as f:
        json.dump({**conf, "pad_token": "<|endoftext|>"}, f)
    vocab = transformers.AutoTokenizer.from_pretrained(hf_dir).vocab_size + 8
    torch.manual_seed(0)
    qwen = transformers.Qwen3Model(transformers.Qwen3Config(vocab_size=vocab, num_key_value_heads=12, head_dim=32,
                                                            **SHAPE)).eval()
    qwen.save_pretrained(hf_dir)
    st = SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=256), Pooling(384, pooling_mode="lasttoken"),
                                      Normalize()], device="cpu")
    st.save(st_dir)
    return st_dir


def _write_bert(hf_dir: str, st_dir: str) -> str:
    """all-MiniLM-L6-v2's kind: a BertModel (random weights) with a WordPiece tokenizer, mean pooling, Normalize."""
    import string

    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    pieces = list(string.ascii_lowercase) + ["##" + c for c in string.ascii_lowercase] + list(".,:()") + list(WORDS)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(dict.fromkeys(pieces))
    os.makedirs(hf_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(os.path.join(hf_dir, "vocab.txt"), do_lower_case=True).save_pretrained(hf_dir)
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(vocab_size=30522, **SHAPE)).eval().save_pretrained(hf_dir)
    st = SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=256), Pooling(384, pooling_mode="mean"),
                                      Normalize()], device="cpu")
    st.save(st_dir)
    return st_dir


def dense_reference(hf_dir: str, tokenizer, texts: list[str], batch: int, ref):
    """A function embedding `texts` with the jitted dense `encoder_forward`, in sentence-transformers' batches
    (checked against `ref` once, every shape compiled before it is returned)."""
    import jax
    import jax.numpy as jnp

    from model import pooling
    from model.families.bert import encoder_forward
    from model.pooling_heads import load_encoder

    cfg, weights = load_encoder(hf_dir)
    forward = jax.jit(encoder_forward, static_argnames="cfg")
    ids = [tokenizer.encode(t) for t in texts]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    batches = []
    for start in range(0, len(order), batch):
        members = order[start:start + batch]
        width = -(-max(len(ids[i]) for i in members) // 32) * 32
        tokens = np.zeros((len(members), width), np.int32)
        mask = np.zeros((len(members), width), np.int32)
        for row, i in enumerate(members):
            tokens[row, :len(ids[i])], mask[row, :len(ids[i])] = ids[i], 1
        batches.append((members, jnp.asarray(tokens), jnp.asarray(mask)))

    def run():
        out = np.zeros((len(ids), cfg.hidden_size), np.float32)
        for members, tokens, mask in batches:
            hidden = forward(weights, tokens, mask, cfg)
            out[members] = np.asarray(pooling.finish_embedding(pooling.pool_dense(hidden, mask, "mean"),
                                                               normalize_output=True))
        return out

    got = run()
    assert np.max(1 - np.sum(got * ref, -1)) < 1e-5, "the dense reference disagrees with sentence-transformers"
    return run


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
    ap.add_argument("--model", choices=("bert", "qwen3"), default="bert")
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--st_batch", type=int, default=32)
    ap.add_argument("--max_num_seqs", type=int, default=32)
    ap.add_argument("--max_num_batched_tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"embedding_throughput_{args.model}_cpu.json")

    import torch
    from sentence_transformers import SentenceTransformer

    from serving import LLM

    with tempfile.TemporaryDirectory() as tmp:
        st_dir = write_checkpoint(tmp, args.model)
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
        runs = {"sentence_transformers": lambda: st.encode(texts, batch_size=args.st_batch, convert_to_numpy=True),
                "ridgeline": lambda: llm.embed(texts)}
        if args.model == "bert":
            runs["xla_dense"] = dense_reference(os.path.join(tmp, "hf"), llm.tokenizer, texts, args.st_batch, ref)
        best = best_of_rotating_rounds(runs, args.rounds)
    rate = {name: len(texts) / seconds for name, seconds in best.items()}
    ratio = rate["ridgeline"] / rate["sentence_transformers"]
    if "xla_dense" in rate:
        print(f"ridgeline / the dense XLA forward: {rate['ridgeline'] / rate['xla_dense']:.2f}x")
    h, f, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    mlp = 2 if args.model == "bert" else 3  # BERT's plain MLP (up, down); Qwen3's gated one (gate, up, down)
    flops_per_token = 2 * layers * (4 * h * h + mlp * h * f)  # the linear layers (attention's scores apart)
    gflops = {name: sum(lengths) * flops_per_token / seconds / 1e9 for name, seconds in best.items()}
    for name in best:
        print(f"{name:>22}: {best[name]:.2f} s, {rate[name]:.1f} texts/s, {sum(lengths) / best[name]:.0f} tokens/s, "
              f"{gflops[name]:.0f} GFLOP/s in the linear layers")
    print(f"ridgeline / sentence-transformers: {ratio:.2f}x")
    startup.save(args.out, {
        "benchmark": "embedding_throughput", "model": args.model, "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch_threads": torch.get_num_threads(),
        "shape": SHAPE, "inputs": len(texts), "tokens": sum(lengths), "st_batch": args.st_batch,
        "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "max_cosine_distance": distance, "seconds": best, "texts_per_s": rate, "linear_gflops_per_s": gflops,
        "ratio": ratio,
        "command": "python benchmarks/embedding_throughput.py " + " ".join(sys.argv[1:]),
    })


if __name__ == "__main__":
    main()
