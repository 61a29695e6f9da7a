"""LoRA adapters over HTTP: `model` picks the adapter, `/v1/models` lists them, the load / unload routes
answer 4xx with reasons (never 200 for a failed load), the server keeps serving, no KV page leaks, and the
metrics routers read.

One server over a tiny random Llama (vocabulary 320, so the byte tokenizer gives text) with adapters written
by `peft`; expected tokens come from PEFT + transformers.
"""

from __future__ import annotations

import json
import os
import shutil

import httpx
import openai
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from model.tokenizer import ByteTokenizer  # noqa: E402
from serving import LLM  # noqa: E402
from serving.api.http_auth import APIKeys  # noqa: E402
from serving.server import ServerThread  # noqa: E402
from tests.conftest import metric_value  # noqa: E402
from tests.test_hf_parity import hf_greedy, save_and_convert, scale_weights_  # noqa: E402
from tests.test_lora_format import make_adapter  # noqa: E402

KEY = "secret-key"
BASE = "tiny-base"
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
N = 5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)).eval()
    scale_weights_(hf)
    hf_dir, _, cfg, params = save_and_convert(hf, tmp_path_factory, "lora_server")
    paths, expected = {}, {BASE: hf_greedy(hf, PROMPT, N)}
    for i, (name, targets, rank) in enumerate([("sql", ["q_proj", "v_proj"], 4),
                                               ("chat", ["o_proj", "gate_proj", "down_proj"], 8),
                                               ("big", ["q_proj"], 16)]):
        paths[name] = str(tmp_path_factory.mktemp(name))
        expected[name] = hf_greedy(make_adapter(hf_dir, paths[name], targets, rank, False, seed=40 + i), PROMPT, N)
    llm = LLM(config=cfg, params=params, enable_lora=True, lora_modules=f"sql={paths['sql']}", max_loras=2,
              max_lora_rank=8, max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=8, page_size=8,
              num_pages=32, max_model_len=64, warmup=True)
    thread = ServerThread(llm, model_name=BASE, api_keys=APIKeys.parse(KEY, False), allow_lora_updates=True).start()
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0)
    yield thread, client, llm, paths, expected
    thread.stop()


def complete(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.model == (model or BASE)  # an adapter's answer names the adapter, as vLLM's does
    return r.choices[0].text


def text(ids):
    return ByteTokenizer(320).decode(ids)


def post(thread, route, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(thread.url + route, json=body, headers=headers, timeout=60)


def test_model_picks_the_adapter_and_models_lists_it(stack):
    thread, client, _, paths, expected = stack
    assert complete(client, BASE) == text(expected[BASE])
    assert complete(client, "sql") == text(expected["sql"])
    chunks = client.completions.create(model="sql", prompt=PROMPT, max_tokens=N, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text(expected["sql"])
    assert {c.model for c in chunks} == {"sql"}
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.model == "sql"
    assert client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).model == BASE
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "sql"}
    assert cards["sql"].parent == BASE and cards["sql"].root == paths["sql"]
    assert client.models.retrieve("sql").parent == BASE
    # An unknown model: vLLM's 404 on every OpenAI route, the same body.
    want = {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "nope")
    assert e.value.body == want
    for route, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/responses", {"input": "hi"}), ("/v1/models/nope", None)]:
        r = (httpx.get(thread.url + route, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) if body is None
             else post(thread, route, {"model": "nope", **body}))
        assert r.status_code == 404 and r.json()["error"] == want, route


def test_load_and_unload_at_run_time(stack, tmp_path):
    thread, client, llm, paths, expected = stack
    assert post(thread, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": paths["chat"]},
                key=None).status_code == 401
    missing = post(thread, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    big = post(thread, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": paths["big"]})
    assert big.status_code == 400 and "exceeds max_lora_rank=8" in big.json()["error"]["message"]
    dora = str(tmp_path / "dora")
    shutil.copytree(paths["chat"], dora)
    with open(os.path.join(dora, "adapter_config.json")) as f:
        conf = json.load(f)
    with open(os.path.join(dora, "adapter_config.json"), "w") as f:
        json.dump({**conf, "use_dora": True}, f)
    bad = post(thread, "/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": dora})
    assert bad.status_code == 400 and "use_dora" in bad.json()["error"]["message"]
    taken = post(thread, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": paths["chat"]})
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
    assert post(thread, "/v1/load_lora_adapter", {"lora_name": "chat"}).status_code == 400
    assert {m.id for m in client.models.list().data} == {BASE, "sql"}  # none of the failures registered
    ok = post(thread, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": paths["chat"]})
    assert ok.status_code == 200, ok.text
    assert complete(client, "chat") == text(expected["chat"])
    assert complete(client, "sql") == text(expected["sql"])
    assert post(thread, "/v1/unload_lora_adapter", {"lora_name": "ghost"}).status_code == 404
    assert post(thread, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    with pytest.raises(openai.NotFoundError):  # unloaded: an unknown model
        complete(client, "chat")
    assert complete(client, BASE) == text(expected[BASE])  # still serving
    assert llm.engine.block_manager.num_used_blocks == 0  # every request's pages went back


def test_lora_metrics(stack):
    thread, client, _, _, _ = stack
    complete(client, "sql")
    body = httpx.get(thread.url + "/metrics", timeout=30).text
    info = [line for line in body.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
    assert 'waiting_lora_adapters=""' in info[0] and float(info[0].rsplit(" ", 1)[1]) > 1e9
    assert metric_value(body, "ridgeline:lora_requests", require=True, lora_name="sql") >= 2
