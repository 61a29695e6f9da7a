"""A mixture of experts through the rest of the stack: speculative decoding keeps its greedy tokens, and
the HTTP server answers what `LLM.generate` does and prices its utilization with active parameters."""

from __future__ import annotations

import httpx
import jax
import openai
import pytest

from conftest import metric_value, tiny_config
from model.families import active_params, expert_params, num_params
from model.params import init_params
from model.tokenizer import ByteTokenizer
from serving import LLM, SamplingParams
from serving.api.http_metrics import DevicePeak
from serving.server import ServerThread

V = 300
# Qwen2-MoE's layer (biases, a shared expert beside 4 routed experts, top 2).
CFG = tiny_config(vocab_size=V, architecture="Qwen2MoeForCausalLM", attention_bias=True, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, moe_router="softmax_topk", norm_topk_prob=False,
                  shared_expert_intermediate_size=48, max_position_embeddings=256)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, num_pages=48, min_token_bucket=32,
              min_context_bucket=96)
PROMPTS = [[1] + [5, 6, 7, 8] * 6, [1, 40, 41, 42, 40, 41, 42, 40, 41]]  # repetitive: n-gram drafts get accepted


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(11))


def _greedy(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_speculative_decoding_keeps_the_moe_greedy_tokens(params):
    want = _greedy(LLM(config=CFG, params=params, **ENGINE))
    spec = LLM(config=CFG, params=params, speculative_method="ngram", num_speculative_tokens=3, **ENGINE)
    assert _greedy(spec) == want
    assert spec.engine.stats().spec_decode.num_draft_tokens > 0


def test_the_server_serves_a_moe_model_and_counts_active_parameters(params):
    llm = LLM(config=CFG, params=params, tokenizer=ByteTokenizer(V), warmup=True, **ENGINE)
    want = _greedy(llm)
    thread = ServerThread(llm, model_name="tiny-moe", peak=DevicePeak("test device", bandwidth=50e9,
                                                                       flops=1e12)).start()
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, tokens in zip(PROMPTS, want):
            out = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=20, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == llm.tokenizer.decode(tokens)
        text = httpx.get(thread.url + "/metrics", timeout=30).text
        cost = thread.metrics.window.cost
    finally:
        thread.stop()
    assert metric_value(text, "vllm:generation_tokens", require=True) >= 40
    # MFU prices a token at its active weights: the routed experts it uses and the shared one, not all four.
    untied, norms = CFG.vocab_size * CFG.hidden_size, CFG.hidden_size * (2 * CFG.num_layers + 1)
    assert cost.flops_per_token == 2.0 * (active_params(CFG) - untied - norms)
    assert active_params(CFG) == num_params(CFG) - expert_params(CFG) // 2  # top 2 of 4 routed experts
