"""The program tests/test_multihost.py runs in every process of a multi-process run.

    python -m serving.launch --num_processes=2 --devices_per_process=2 -- \\
        python tests/multihost_worker.py --out DIR [--layouts tp4 pp2tp2] [--die_process 1 --die_after_steps 3]

For each layout (`tp4`: tensor parallelism over the 4 devices of both
processes; `pp2tp2`: two pipeline stages, one per process, each 2-way tensor
parallel, 2 microbatches) each process builds the same `LLM` (a small random
model, seeded, so every process and the test's own single-process reference
hold the same weights), runs `generate` on a mixed batch and writes the token
ids it got back to DIR/p<process>.json. `--die_process P --die_after_steps K` makes process P
kill itself (SIGKILL) when it reaches its K-th step, to test failure detection.

`--features` runs, for each layout, the engine's optional features instead:
a byte-vocabulary model with a draft model (speculative decoding), a batch
mixing sampling controls (logit bias, penalties, bad words, `min_tokens`), a
regex-constrained request and plain ones; then process 0 exports a prompt's
KV (`kv_transfer.Exporter`), writes the signed payload to
DIR/export-<layout>.bin and imports it back into the same multi-process
engine.
`features_engine` builds the same engine in one process for the test's
reference.

`--lora` runs, after the layouts, LoRA adapters at pp2tp2: two random PEFT-format adapters
(`write_adapters`, each process its own copy of the same files) and a batch mixing them with the base
model (`LORA_OF`); process 0 loads the slots, process 1 replays the writes (`lora_engine` builds the
same engine in one process for the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.config import LlamaConfig  # noqa: E402
from model.params import init_params  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.spec_decode import SpecDecoder
from serving.cluster import distributed

CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=8, num_kv_heads=4,
                  head_dim=8, rope_theta=10000.0, dtype="float32", max_position_embeddings=1024,
                  bos_token_id=1, eos_token_ids=(2,))
ENGINE = dict(page_size=8, max_model_len=128, num_pages=64, max_num_seqs=8, max_num_batched_tokens=32,
              min_token_bucket=32, min_context_bucket=128, attention_backend="reference")


def params():
    return init_params(CFG, jax.random.key(11))


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Ragged prompts, some longer than the token budget (so their prefill is chunked)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, CFG.vocab_size) for _ in range(rng.randint(2, 45))] for _ in range(n)]


def sampling(max_tokens: int = 8) -> list[SamplingParams]:
    """Greedy, with varied lengths; one request forks two samples (its pages are copied on write)."""
    out = []
    for i in range(len(prompts())):
        out.append(SamplingParams(temperature=0.0, max_tokens=max_tokens + 3 * i, ignore_eos=True, n=2 if i == 2 else 1))
    return out


def token_ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def die_at_step(llm, after: int) -> None:
    """Kills this process (SIGKILL, no clean-up) when it starts its `after`-th step."""
    runner = llm.engine.runner
    run = runner._run
    count = [0]

    def counting_run(*args, **kwargs):
        count[0] += 1
        if count[0] >= after:
            print(f"process {jax.process_index()} kills itself at step {count[0]} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return run(*args, **kwargs)

    runner._run = counting_run


LAYOUTS = {"tp4": dict(tensor_parallel_size=4), "pp2tp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                                 num_microbatches=2)}

# The variant run: the engine features of the composition matrix that change the model or its step, over
# both processes at once: a mixture of experts whose every layer slides (Qwen3-MoE), int8 weights, an fp8
# KV cache and prompt-lookup speculation, at TP=4 (experts split over the tensor devices).
VCFG = CFG.replace(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, moe_router="softmax_topk", norm_topk_prob=True, sliding_window=8)
VARIANT_ENGINE = dict(ENGINE, weight_dtype="int8", kv_cache_dtype="fp8", speculative_method="ngram",
                      num_speculative_tokens=3)


def variant_engine(**layout) -> LLM:
    return LLM(config=VCFG, params=init_params(VCFG, jax.random.key(12)), **VARIANT_ENGINE, **layout)


# --- LoRA adapters over both processes ------------------------------------------------------------
LORA_ENGINE = dict(ENGINE, enable_lora=True, max_loras=2, max_lora_rank=4)
LORA_OF = [None, "a", "b", "a", None, "b"]  # the adapter of each of `prompts()`


def write_adapters(root: str) -> str:
    """Two random adapters in PEFT's format over `CFG`'s projections ("a": rank 4 on q/v and the MLP's down,
    "b": rank 2 on all seven), seeded; their `lora_modules`."""
    from safetensors.numpy import save_file

    from model.families import family_for_config

    targets = {"a": (("q_proj", "v_proj", "down_proj"), 4),
               "b": (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 2)}
    for i, (name, (modules, rank)) in enumerate(targets.items()):
        rng = np.random.default_rng(30 + i)
        tensors = {}
        for plan in family_for_config(CFG).checkpoint_tensors(CFG):
            module = plan.hf[:-len(".weight")]
            if module.rsplit(".", 1)[-1] in modules:
                out_dim, in_dim = plan.hf_shape
                tensors[f"base_model.model.{module}.lora_A.weight"] = rng.normal(0, in_dim ** -0.5, (rank, in_dim)
                                                                                 ).astype(np.float32)
                tensors[f"base_model.model.{module}.lora_B.weight"] = rng.normal(0, rank ** -0.5, (out_dim, rank)
                                                                                 ).astype(np.float32)
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(modules)}, f)
    return ",".join(f"{name}={os.path.join(root, name)}" for name in targets)


def lora_engine(root: str, **layout) -> LLM:
    return LLM(config=CFG, params=params(), lora_modules=write_adapters(root), **LORA_ENGINE, **layout)


# --- the features run: sampling controls, structured outputs, a draft model, KV transfer -----------
# Bytes, BOS 256, EOS 257: the byte tokenizer a vocabulary of 258 or more gets (grammars, bad words).
FCFG = CFG.replace(vocab_size=320, bos_token_id=256, eos_token_ids=(257,))
DRAFT_LAYERS = 2  # the draft model: the target's first layers, so it agrees with it often but not always
# A custom logits processor too (tests/logits_processor_examples.py): process 0 computes its rows, and the
# other processes get them with each step.
FEATURES_ENGINE = dict(ENGINE, max_num_seqs=6, speculative_method="draft", num_speculative_tokens=3,
                       logits_processors="logits_processor_examples:ForceAt")
FORCED = {"force": ord("z"), "at": [1, 3, 4]}  # the extra_args of job 5
KV_KEYS = "a secret both sides share"


def features_params():
    return init_params(FCFG, jax.random.key(5))


def features_draft():
    import dataclasses

    p = features_params()
    return FCFG.replace(num_layers=DRAFT_LAYERS), dataclasses.replace(p, layers=p.layers[:DRAFT_LAYERS])


def features_engine(**layout) -> LLM:
    return LLM(config=FCFG, params=features_params(), speculative_draft=features_draft(), **FEATURES_ENGINE,
               **layout)


def features_jobs() -> list[tuple[list[int], SamplingParams]]:
    """A mixed batch: every sampling control, a regex, a logits processor, plain greedy rows (some with chunked
    prefills)."""
    rng = random.Random(4)

    def prompt(n):
        return [256] + [rng.randrange(32, 127) for _ in range(n)]

    greedy = dict(temperature=0.0, ignore_eos=True)
    return [
        (prompt(40), SamplingParams(max_tokens=14, **greedy)),
        (prompt(6), SamplingParams(max_tokens=12, logit_bias={ord("a"): 4.0, ord("e"): -100.0},
                                   presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, **greedy)),
        (prompt(12), SamplingParams(max_tokens=10, bad_words=["ab", "x"], frequency_penalty=1.5, **greedy)),
        (prompt(9), SamplingParams(temperature=0.0, max_tokens=9, min_tokens=6, logit_bias={257: 30.0})),
        (prompt(20), SamplingParams(temperature=0.0, max_tokens=20,
                                    structured_outputs={"regex": r"(def|class) [a-z_]{2,8}\(self\)"})),
        (prompt(3), SamplingParams(max_tokens=16, extra_args=FORCED, **greedy)),
        (prompt(10), SamplingParams(max_tokens=8, n=2, **greedy)),
        (prompt(15), SamplingParams(max_tokens=8, logprobs=2, **greedy)),
    ]


def features_second_wave() -> tuple[list[dict], SamplingParams]:
    """The first job's prompt again: once under no salt (its pages are cached by then), once under a
    tenant's salt (nothing of the first run may be reused)."""
    first = features_jobs()[0][0]
    return ([{"prompt_token_ids": first}, {"prompt_token_ids": first, "cache_salt": "tenant-b"}],
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))


def chosen_logprobs(output) -> list[float]:
    """Sample 0's logprob of each of its tokens."""
    c = output.outputs[0]
    return [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]


def export_job() -> tuple[list[int], SamplingParams]:
    rng = random.Random(9)
    return [256] + [rng.randrange(32, 127) for _ in range(27)], SamplingParams(temperature=0.0, max_tokens=10,
                                                                              ignore_eos=True)


def _run(engine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def export_and_import(llm: LLM) -> dict:
    """Process 0: prefills `export_job` with a KV export, writes the payload, imports it back (same engine)."""
    from serving.disaggregation import kv_transfer as kt
    from serving.disaggregation import kv_wire

    engine, keys = llm.engine, kv_wire.SigningKeys(KV_KEYS)
    prompt, sp = export_job()
    first = sp.clone()
    first.max_tokens = 1
    exports = []
    req = engine.make_request("export", prompt, first, part_args={"kv_export": kt.Exporter(exports.append)})
    engine.enqueue(req)
    _run(engine)
    (exp,) = exports
    payload = kt.encode_payload(exp, engine.cfg, engine.runner.kv_dtype, keys)
    engine.reset_prefix_cache()  # the import writes every token, none comes from the export's cached pages
    return {"payload": payload, "first_token": exp.first_token, "imported": import_payload(engine, payload)}


def import_payload(engine, payload: bytes) -> list[int]:
    """Resumes `export_job` on `engine` from a shipped payload (its KV scattered into the pool); its tokens."""
    from serving.disaggregation import kv_transfer as kt
    from serving.disaggregation import kv_wire

    keys, dtype = kv_wire.SigningKeys(KV_KEYS), engine.runner.kv_dtype
    header, body = kt.decode_payload(payload, keys, engine.cfg, dtype, engine.max_model_len)
    imp = kt.to_import(header, body, engine.cfg, dtype)
    prompt, sp = export_job()
    req = engine.make_request("import", prompt, sp, part_args={"kv_import": imp})
    engine.enqueue(req)
    return list(_run(engine)["import"].outputs[0].token_ids)


def run_features(out_dir: str, layout: str) -> dict:
    me = jax.process_index()
    llm = features_engine(**LAYOUTS[layout])
    print(f"process {me} of {jax.process_count()}: features at {layout} over {jax.device_count()} devices",
          flush=True)
    jobs = features_jobs()
    outputs = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    again = llm.generate(*features_second_wave())
    role = llm.multihost
    if role.is_leader:
        with role.operation():
            try:
                shipped = export_and_import(llm)
            except BaseException as e:
                role.failed("export and import", e)
                raise
            role.end()
        with open(os.path.join(out_dir, f"export-{layout}.bin"), "wb") as f:
            f.write(shipped.pop("payload"))
        spec = llm.engine.part(SpecDecoder).stats
        shipped["spec"] = {"drafted": spec.num_draft_tokens, "accepted": spec.num_accepted_tokens}
    else:
        role.follow()
        shipped = None
    return {"tokens": token_ids(outputs), "texts": [o.outputs[0].text for o in outputs], "shipped": shipped,
            "logprobs": chosen_logprobs(outputs[-1]), "again": token_ids(again),
            "cached": [o.num_cached_tokens for o in again],
            "replayed": getattr(role, "calls_by_kind", None), "state": replicated_state(llm)}


def replicated_state(llm: LLM) -> dict:
    """A digest of this process's copy of the state every device holds whole: the draft model's KV cache and
    the sampling-control slots. Equal on every process only if each ran the same calls with the same inputs."""
    import hashlib

    def digest(tree) -> str:
        h = hashlib.sha256()
        for x in jax.tree.leaves(tree):
            h.update(np.asarray(x.addressable_data(0)).tobytes())
        return h.hexdigest()

    return {"draft_cache": digest(llm.engine.part(SpecDecoder).proposer.cache), "controls": digest(llm.engine.runner.part_states)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", nargs="+", default=["tp4"], choices=sorted(LAYOUTS))
    ap.add_argument("--max_tokens", type=int, default=8)
    ap.add_argument("--die_process", type=int, default=None)
    ap.add_argument("--die_after_steps", type=int, default=3)
    ap.add_argument("--features", action="store_true", help="the features run instead of the layouts")
    ap.add_argument("--variant", action="store_true", help="after the layouts, the variant run at TP=4")
    ap.add_argument("--lora", action="store_true", help="after the layouts, LoRA adapters at pp2tp2")
    args = ap.parse_args()
    distributed.initialize()  # before anything touches a device (the params below do)
    me = jax.process_index()
    result = {"process": me}
    if args.features:
        result["features"] = {name: run_features(args.out, name) for name in args.layouts}
        args.layouts = []
    for name in args.layouts:
        llm = LLM(config=CFG, params=params(), **LAYOUTS[name], **ENGINE)
        print(f"process {me} of {jax.process_count()}: {name} over {jax.local_device_count()} local devices, "
              f"{jax.device_count()} in all", flush=True)
        if args.die_process == me:
            die_at_step(llm, args.die_after_steps)
        outputs = llm.generate(prompts(), sampling(args.max_tokens))
        replayed = getattr(llm.multihost, "calls_by_kind", None)  # a follower's count of replayed calls
        result[name] = {"tokens": token_ids(outputs), "replayed": replayed}
    if args.variant:
        llm = variant_engine(**LAYOUTS["tp4"])
        outputs = llm.generate(prompts(), sampling(args.max_tokens))
        spec = llm.engine.part(SpecDecoder).stats
        result["variant"] = {"tokens": token_ids(outputs), "drafted": spec.num_draft_tokens,
                             "replayed": getattr(llm.multihost, "calls_by_kind", None)}
    if args.lora:
        llm = lora_engine(os.path.join(args.out, f"adapters-p{me}"), **LAYOUTS["pp2tp2"])
        outputs = llm.generate(prompts(), sampling(args.max_tokens), lora_request=LORA_OF)
        result["lora"] = {"tokens": token_ids(outputs), "replayed": getattr(llm.multihost, "calls_by_kind", None)}
    with open(os.path.join(args.out, f"p{me}.json"), "w") as f:
        json.dump(result, f)
    print(f"process {me} done", flush=True)


if __name__ == "__main__":
    main()
