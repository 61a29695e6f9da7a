"""Pooling requests through the engine (`serving.features.pooling`), `LLM.embed` / `classify` / `reward` / `score`,
and the pooling routes with the official clients.

Tiny random Qwen3 checkpoints saved on the spot: an embedder as sentence-transformers saves Qwen3-Embedding
(last-token pooling, Normalize), and a one-label `Qwen3ForSequenceClassification` (a reranker / reward model).
References: `SentenceTransformer.encode` and transformers' logits, fp32.
"""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

from serving.core.sampling_params import InvalidParameterError, SamplingParams
from serving.features.pooling import PoolingParams, pooling_sampling_params
from tests.conftest import run_to_completion
from tests.hf_tokenizer_styles import save_style

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from serving import LLM  # noqa: E402
from serving.api.http_auth import APIKeys  # noqa: E402
from serving.server import ServerThread  # noqa: E402
from tests.test_pooling_models import TEXTS, _qwen3_config, cosine_distance, scale_  # noqa: E402

KEY = "pool-key"
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=96, max_model_len=96,
              compilation_cache_dir="")
LONG = "the quick brown fox jumps over the lazy dog. " * 4  # several prefill chunks of 16 tokens
QUERY, DOCS = "what is the capital of France?", ["Paris is the capital of France.", "def f(x): return x",
                                                 "the quick brown fox"]


def _tokenizer_dir(directory: str) -> int:
    """A Qwen-style byte-level tokenizer without a chat template, padding with <|endoftext|>; its vocabulary size."""
    save_style("bytelevel_nobos", directory)
    with open(f"{directory}/tokenizer_config.json") as f:
        conf = json.load(f)
    conf.pop("chat_template", None)  # with a template, sentence-transformers 6 encodes texts as chat messages
    with open(f"{directory}/tokenizer_config.json", "w") as f:
        json.dump({**conf, "pad_token": "<|endoftext|>"}, f)
    return transformers.AutoTokenizer.from_pretrained(directory).vocab_size + 8


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(sentence-transformers directory, its HF model, an LLM over it)."""
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    hf_dir, st_dir = str(tmp_path_factory.mktemp("hf")), str(tmp_path_factory.mktemp("st"))
    vocab = _tokenizer_dir(hf_dir)
    torch.manual_seed(0)
    hf = scale_(transformers.Qwen3Model(_qwen3_config(vocab_size=vocab)).eval())
    hf.save_pretrained(hf_dir)
    model = st.SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=64),
                                            Pooling(32, pooling_mode="lasttoken"), Normalize()], device="cpu")
    model.save(st_dir)
    return st_dir, hf, LLM(model=st_dir, **ENGINE)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """(HF directory, its HF model and tokenizer, an LLM over it) of a one-label Qwen3 sequence classifier."""
    hf_dir = str(tmp_path_factory.mktemp("cls"))
    vocab = _tokenizer_dir(hf_dir)
    torch.manual_seed(1)
    hf = scale_(transformers.Qwen3ForSequenceClassification(
        _qwen3_config(vocab_size=vocab, num_labels=1, pad_token_id=0)).eval())
    hf.save_pretrained(hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return hf_dir, hf, tok, LLM(model=hf_dir, **ENGINE)


def _hf_logit(hf, ids) -> float:
    with torch.no_grad():
        return float(hf(torch.tensor([ids])).logits[0, 0])


def test_embed_matches_sentence_transformers(embedder):
    st_dir, _, llm = embedder
    ref = st.SentenceTransformer(st_dir, device="cpu").encode(TEXTS + [LONG], convert_to_numpy=True)
    out = llm.embed(TEXTS + [LONG])
    ours = np.stack([o.outputs.data for o in out])
    assert cosine_distance(ours, ref).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, rtol=1e-5)
    assert out[0].outputs.embedding == pytest.approx(ours[0].tolist())
    raw = llm.embed(TEXTS[:1], PoolingParams("embed", normalize=False))[0].outputs.data
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and cosine_distance(raw, ref[0]) < 1e-5
    with pytest.raises(InvalidParameterError, match="matryoshka"):  # the model was not trained for it
        llm.embed(TEXTS[:1], PoolingParams("embed", dimensions=8))


def test_pooling_and_generation_in_one_batch_equal_alone(embedder):
    """Generation and pooling requests share steps; each gets what it gets alone."""
    _, _, llm = embedder
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    gen_prompts = ["The capital of France", LONG]
    alone_gen = [o.outputs[0].token_ids for o in llm.generate(gen_prompts, greedy)]
    alone_emb = [o.outputs.data for o in llm.embed(TEXTS)]
    engine = llm.engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", p, greedy)
    for i, p in enumerate(TEXTS):
        engine.add_request(f"e{i}", p, pooling_sampling_params(), part_args={"pooling": PoolingParams()})
    done = run_to_completion(engine)
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(2)] == alone_gen
    for i in range(len(TEXTS)):
        np.testing.assert_allclose(done[f"e{i}"].pooled, alone_emb[i], rtol=1e-5, atol=1e-6)
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests


def test_mean_pooling_spans_chunks_and_never_reads_the_prefix_cache(embedder, tmp_path):
    """Mean pooling over prefill chunks of 16 equals transformers' mean; a repeated prompt is recomputed whole
    (its cached pages would skip rows the mean needs), while last-token pooling reuses them."""
    st_dir, hf, last_llm = embedder
    llm = LLM(model=st_dir, pooler_config='{"pooling_type": "MEAN", "normalize": false}', **ENGINE)
    ids = llm.tokenizer.encode(LONG)
    assert len(ids) > 32
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()
    outs = []
    for round_ in range(2):
        llm.engine.add_request(f"m{round_}", ids, pooling_sampling_params(), part_args={"pooling": PoolingParams()})
        outs.append(run_to_completion(llm.engine)[f"m{round_}"])
    for out in outs:
        np.testing.assert_allclose(out.pooled, ref, rtol=1e-4, atol=1e-4)
        assert out.num_cached_tokens == 0
    np.testing.assert_array_equal(outs[0].pooled, outs[1].pooled)
    cached = []
    for round_ in range(2):
        last_llm.engine.add_request(f"l{round_}", ids, pooling_sampling_params(), part_args={"pooling": PoolingParams()})
        cached.append(run_to_completion(last_llm.engine)[f"l{round_}"])
    assert cached[1].num_cached_tokens > 0
    np.testing.assert_allclose(cached[1].pooled, cached[0].pooled, rtol=1e-5, atol=1e-6)


def test_truncation_and_length_errors(embedder):
    _, _, llm = embedder
    ids = llm.tokenizer.encode(LONG * 2)
    assert len(ids) > 64  # the sentence-transformers max_seq_length
    with pytest.raises(InvalidParameterError, match=rf"maximum input length is 64 tokens.*{len(ids)} tokens"):
        llm.embed([ids])
    cut = llm.embed([ids], truncate_prompt_tokens=10)[0].outputs.data
    np.testing.assert_allclose(cut, llm.embed([ids[:10]])[0].outputs.data, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(llm.embed([ids], truncate_prompt_tokens=-1)[0].outputs.data,
                               llm.embed([ids[:64]])[0].outputs.data, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidParameterError, match="score head"):
        llm.classify(TEXTS[:1])


def test_classifier_scores_match_transformers(classifier):
    _, hf, tok, llm = classifier
    ids = [tok(t)["input_ids"] for t in TEXTS]
    logits = np.asarray([_hf_logit(hf, i) for i in ids], np.float32)
    reward = np.concatenate([o.outputs.data for o in llm.reward(TEXTS)])
    np.testing.assert_allclose(reward, logits, atol=1e-5)
    probs = np.concatenate([o.outputs.data for o in llm.classify(TEXTS)])  # one label: a sigmoid
    np.testing.assert_allclose(probs, 1 / (1 + np.exp(-logits)), atol=1e-6)
    pair_logits = [_hf_logit(hf, tok(QUERY, d)["input_ids"]) for d in DOCS]
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-np.asarray(pair_logits))), atol=1e-6)
    with pytest.raises(InvalidParameterError, match="classifier"):
        llm.embed(TEXTS[:1])


def test_a_generation_model_refuses_pooling(small_cfg):
    import jax
    from model.params import init_params

    llm = LLM(config=small_cfg, params=init_params(small_cfg, jax.random.PRNGKey(0)), max_num_seqs=2,
              max_num_batched_tokens=16, num_pages=16, page_size=4)
    with pytest.raises(InvalidParameterError, match="runner=pooling"):
        llm.embed([[1, 2, 3]])
    with pytest.raises(InvalidParameterError, match="runner=pooling"):
        llm.engine.make_request("x", [1, 2, 3], pooling_sampling_params(), part_args={"pooling": PoolingParams()})


# --- the routes ---

@pytest.fixture(scope="module")
def embed_server(embedder):
    thread = ServerThread(embedder[2], model_name="tiny-embed", api_keys=APIKeys.parse(KEY, False)).start()
    yield thread, embedder
    thread.stop()


def post(thread, route, body, key=KEY):
    return httpx.post(thread.url + route, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_openai_client_embeddings_float_and_base64(embed_server):
    thread, (_, _, llm) = embed_server
    want = np.stack([o.outputs.data for o in llm.embed(TEXTS)])
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0)
    got = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in got.data], want, rtol=1e-5, atol=1e-6)
    assert got.usage.prompt_tokens == sum(len(llm.tokenizer.encode(t)) for t in TEXTS)
    got64 = client.embeddings.create(model="tiny-embed", input=TEXTS[0])  # the client asks for base64
    np.testing.assert_allclose(got64.data[0].embedding, want[0], rtol=1e-5, atol=1e-6)
    ids = client.embeddings.create(model="tiny-embed", input=[llm.tokenizer.encode(TEXTS[1])], encoding_format="float")
    np.testing.assert_allclose(ids.data[0].embedding, want[1], rtol=1e-5, atol=1e-6)
    raw = post(thread, "/v1/embeddings", {"input": TEXTS[2], "encoding_format": "base64", "user": "u1"}).json()
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"), want[2], rtol=1e-5, atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model="tiny-embed", input="x", dimensions=8)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=thread.url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            model="tiny-embed", input="x")


def test_langchain_openai_embeddings(embed_server):
    lc = pytest.importorskip("langchain_openai")
    thread, (_, _, llm) = embed_server
    emb = lc.OpenAIEmbeddings(model="tiny-embed", base_url=thread.url + "/v1", api_key=KEY,
                              check_embedding_ctx_length=False)  # (its token counting downloads tiktoken files)
    want = [o.outputs.data for o in llm.embed(TEXTS[:2])]
    np.testing.assert_allclose(emb.embed_documents(TEXTS[:2]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(emb.embed_query(TEXTS[0]), want[0], rtol=1e-5, atol=1e-6)


def test_pooling_route_errors_keep_serving_and_free_pages(embed_server):
    thread, (_, _, llm) = embed_server
    tokens = post(thread, "/pooling", {"input": TEXTS[0], "task": "token_embed"}).json()
    ids = llm.tokenizer.encode(TEXTS[0])
    assert np.asarray(tokens["data"][0]["data"]).shape == (len(ids), 32)
    bad = [({"input": TEXTS[0], "colour": "red"}, "colour"),  # an unknown field is not ignored
           ({"input": []}, "input"),
           ({"input": LONG * 2}, "maximum input length"),
           ({"input": [10**6]}, "token ids"),
           ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]
    for body, words in bad:
        r = post(thread, "/v1/embeddings", body)
        assert r.status_code == 400 and words in r.text, (body, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    r = post(thread, "/classify", {"input": "x"})
    assert r.status_code == 400 and "score head" in r.text
    assert post(thread, "/v1/embeddings", {"input": "still serving"}).status_code == 200
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def rerank_server(classifier):
    thread = ServerThread(classifier[3], model_name="tiny-rerank", api_keys=APIKeys.parse(KEY, False)).start()
    yield thread, classifier
    thread.stop()


def test_score_and_rerank_routes_as_jina_and_cohere_send_them(rerank_server):
    thread, (_, hf, tok, _) = rerank_server
    want = 1 / (1 + np.exp(-np.asarray([_hf_logit(hf, tok(QUERY, d)["input_ids"]) for d in DOCS])))
    score = post(thread, "/score", {"model": "tiny-rerank", "text_1": QUERY, "text_2": DOCS}).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-6)
    order = np.argsort(-want).tolist()
    jina = post(thread, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS, "top_n": 2,
                                       "return_documents": True}).json()
    assert [r["index"] for r in jina["results"]] == order[:2]
    assert jina["results"][0]["document"]["text"] == DOCS[order[0]]
    np.testing.assert_allclose([r["relevance_score"] for r in jina["results"]], want[order[:2]], atol=1e-6)
    cohere = pytest.importorskip("cohere")
    co = cohere.ClientV2(api_key=KEY, base_url=thread.url)
    res = co.rerank(model="tiny-rerank", query=QUERY, documents=DOCS, top_n=3)
    assert [r.index for r in res.results] == order
    np.testing.assert_allclose([r.relevance_score for r in res.results], want[order], atol=1e-6)
    probs = post(thread, "/classify", {"input": [QUERY]}).json()["data"][0]
    assert probs["num_classes"] == 1 and probs["label"] == "LABEL_0"
    r = post(thread, "/v1/embeddings", {"input": "x"})
    assert r.status_code == 400 and "classifier" in r.text


def test_a_generation_server_answers_the_pooling_routes_with_a_400(small_cfg):
    import jax
    from model.params import init_params

    llm = LLM(config=small_cfg, params=init_params(small_cfg, jax.random.PRNGKey(0)), max_num_seqs=2,
              max_num_batched_tokens=16, num_pages=16, page_size=4)
    thread = ServerThread(llm, model_name="gen").start()
    try:
        for route, body in (("/v1/embeddings", {"input": "x"}), ("/rerank", {"query": "q", "documents": ["d"]})):
            r = httpx.post(thread.url + route, json=body, timeout=30)
            assert r.status_code == 400 and "runner=pooling" in r.text
    finally:
        thread.stop()


# --- composition: tensor parallelism, quantized weights, adapters, priorities ---

def test_pooling_composes_with_tp_int8_weights_lora_and_priority(embedder, tmp_path):
    peft = pytest.importorskip("peft")
    from serving.features.lora import LoRARequest

    st_dir, hf, llm = embedder
    base = np.stack([o.outputs.data for o in llm.embed(TEXTS)])
    tp = LLM(model=st_dir, tensor_parallel_size=2, **ENGINE)
    np.testing.assert_allclose(np.stack([o.outputs.data for o in tp.embed(TEXTS)]), base, rtol=1e-5, atol=1e-5)
    int8 = np.stack([o.outputs.data for o in LLM(model=st_dir, weight_dtype="int8", **ENGINE).embed(TEXTS)])
    assert 1e-9 < cosine_distance(int8, base).max() < 1e-2  # quantized (not the float weights), and close

    torch.manual_seed(3)  # an adapter trained on the base model, as PEFT saves it for an embedder
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    adapter_dir = str(tmp_path / "adapter")
    adapted.save_pretrained(adapter_dir)
    tok = llm.tokenizer
    with torch.no_grad():
        ref = np.stack([adapted(torch.tensor([tok.encode(t)])).last_hidden_state[0, -1].numpy() for t in TEXTS])
    adapted.unload()  # (the module fixture's model keeps its own weights)
    ref /= np.linalg.norm(ref, axis=-1, keepdims=True)
    lora = LLM(model=st_dir, enable_lora=True, max_lora_rank=4, scheduling_policy="priority", **ENGINE)
    got = np.stack([o.outputs.data for o in lora.embed(TEXTS, lora_request=LoRARequest("a", 1, adapter_dir),
                                                       priority=[1, 0, 1, 0])])
    assert cosine_distance(got, ref).max() < 1e-5 and cosine_distance(got, base).min() > 1e-4
    np.testing.assert_allclose(np.stack([o.outputs.data for o in lora.embed(TEXTS)]), base, rtol=1e-5, atol=1e-5)


def test_pooling_under_pipeline_stages_equals_one_device(embedder):
    """Two pipeline stages (two microbatches): the last stage shares every row's hidden state, so mean pooling
    over chunks and last-token pooling give what one device gives."""
    st_dir, _, llm = embedder
    base = np.stack([o.outputs.data for o in llm.embed(TEXTS + [LONG])])
    pp = LLM(model=st_dir, pipeline_parallel_size=2, num_microbatches=2, **ENGINE)
    np.testing.assert_allclose(np.stack([o.outputs.data for o in pp.embed(TEXTS + [LONG])]), base, rtol=1e-5,
                               atol=1e-5)
    mean = dict(pooler_config='{"pooling_type": "MEAN"}', **ENGINE)
    one = LLM(model=st_dir, **mean).embed([LONG])[0].outputs.data
    np.testing.assert_allclose(LLM(model=st_dir, pipeline_parallel_size=2, **mean).embed([LONG])[0].outputs.data,
                               one, rtol=1e-5, atol=1e-5)


def test_the_pooling_routes_count_toward_the_per_key_limit():
    """`--max_concurrent_requests_per_key` bounds the pooling routes outside /v1/ as it does /v1/*."""
    import asyncio

    from serving.api.request_limits import KeyConcurrency

    async def run():
        release, seen = asyncio.Event(), []

        async def app(scope, receive, send):  # holds every request until released
            seen.append(scope["path"])
            await release.wait()

        limited = KeyConcurrency(app, limit=1)
        sent = []

        async def send(message):
            sent.append(message)

        def scope(path):
            return {"type": "http", "method": "POST", "path": path, "headers": [(b"authorization", b"Bearer k")],
                    "client": ("1.2.3.4", 1)}

        first = asyncio.create_task(limited(scope("/rerank"), None, send))
        await asyncio.sleep(0.01)
        for path in ("/pooling", "/classify", "/score", "/v2/rerank", "/v1/embeddings"):
            await limited(scope(path), None, send)
        release.set()
        await first
        return seen, [m["status"] for m in sent if m["type"] == "http.response.start"]

    seen, statuses = asyncio.run(run())
    assert seen == ["/rerank"] and statuses == [429] * 5


def test_matryoshka_dimensions_truncate_then_normalize(embedder, tmp_path):
    """`dimensions` within the model's `matryoshka_dimensions` (config.json) keeps the first ones and normalizes
    again, as `SentenceTransformer(truncate_dim=)` does; others are refused naming the allowed ones."""
    import shutil

    st_dir, _, llm = embedder
    copy = str(tmp_path / "matryoshka")
    shutil.copytree(st_dir, copy)
    with open(f"{copy}/config.json") as f:
        hf_config = json.load(f)
    with open(f"{copy}/config.json", "w") as f:
        json.dump({**hf_config, "matryoshka_dimensions": [8, 16, 32]}, f)
    ref = st.SentenceTransformer(copy, device="cpu", truncate_dim=16).encode(TEXTS, convert_to_numpy=True)
    short = LLM(model=copy, **ENGINE)
    got = np.stack([o.outputs.data for o in short.embed(TEXTS, PoolingParams("embed", dimensions=16))])
    assert got.shape == (len(TEXTS), 16) and cosine_distance(got, ref).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=1e-5)
    with pytest.raises(InvalidParameterError, match=r"\[8, 16, 32\]"):
        short.embed(TEXTS[:1], PoolingParams("embed", dimensions=12))


# --- encoders through the engine: BERT and XLM-RoBERTa (model.families.encoder) ---

@pytest.mark.parametrize("arch,mode", [("BertModel", "mean"), ("XLMRobertaModel", "cls")])
def test_encoder_embedders_through_the_engine_match_sentence_transformers(tmp_path, arch, mode):
    from tests.test_pooling_models import save_encoder_embedder

    st_dir = save_encoder_embedder(tmp_path, arch, mode)
    ref = st.SentenceTransformer(st_dir, device="cpu").encode(TEXTS, convert_to_numpy=True)
    llm = LLM(model=st_dir, **ENGINE)
    ours = np.stack([o.outputs.data for o in llm.embed(TEXTS)])
    assert cosine_distance(ours, ref).max() < 1e-5
    again = np.stack([o.outputs.data for o in llm.embed(TEXTS[::-1])])[::-1]  # other batches, cached pages
    np.testing.assert_allclose(again, ours, rtol=1e-5, atol=1e-6)
    tp = LLM(model=st_dir, tensor_parallel_size=2, weight_dtype="int8" if mode == "cls" else "auto", **ENGINE)
    sharded = np.stack([o.outputs.data for o in tp.embed(TEXTS)])
    assert cosine_distance(sharded, ours).max() < (1e-2 if mode == "cls" else 1e-6)  # int8 weights: close
    with pytest.raises(InvalidParameterError, match="does not generate"):
        llm.generate(TEXTS[:1], SamplingParams(max_tokens=2))
    ids = llm.tokenizer.encode(" ".join(TEXTS))
    assert len(ids) > 16  # longer than a step: refused, naming both lengths
    with pytest.raises(InvalidParameterError, match=rf"maximum input length is 16 tokens.*{len(ids)} tokens"):
        llm.embed([ids])


def test_an_encoder_is_refused_as_a_generation_model(tmp_path):
    from tests.test_pooling_models import _encoder_config, _wordpiece_dir

    hf_dir = str(tmp_path / "bert")
    _, vocab = _wordpiece_dir(hf_dir)
    transformers.BertModel(_encoder_config(transformers.BertConfig, vocab)).save_pretrained(hf_dir)
    with pytest.raises(ValueError, match="is an encoder"):
        LLM(model=hf_dir, runner="generate", **ENGINE)
    with pytest.raises(ValueError, match="is an encoder: its position and token-type embeddings are not staged"):
        LLM(model=hf_dir, pipeline_parallel_size=2, **ENGINE)


def test_encoder_cross_encoder_and_classifier_through_the_engine(tmp_path):
    from tests.test_pooling_models import _encoder_config, _wordpiece_dir, save_bert_cross_encoder

    bert_dir = str(tmp_path / "bert")
    tok, bert = save_bert_cross_encoder(bert_dir)
    vocab = len(tok)
    pairs = [(TEXTS[0], TEXTS[1]), (TEXTS[0], TEXTS[2]), (TEXTS[3], TEXTS[1])]
    ref = st.CrossEncoder(bert_dir, device="cpu").predict(pairs)
    llm = LLM(model=bert_dir, **dict(ENGINE, max_num_batched_tokens=48))
    got = [o.outputs.score for o in llm.score([a for a, _ in pairs], [b for _, b in pairs])]
    np.testing.assert_allclose(got, ref, atol=1e-5)
    # Truncated pairs keep their token types alike (the second text's type-1 tokens that remain).
    cut = [o.outputs.score for o in llm.score("fox", TEXTS[1], truncate_prompt_tokens=7)]
    batch = tok("fox", TEXTS[1], return_tensors="pt")
    assert batch["input_ids"].shape[1] > 7 and batch["token_type_ids"][0, :7].max() == 1
    with torch.no_grad():
        logit = bert(**{k: v[:, :7] for k, v in batch.items()}).logits[0, 0].item()
    np.testing.assert_allclose(cut, [1 / (1 + np.exp(-logit))], atol=1e-5)

    xlmr_dir = str(tmp_path / "xlmr")
    _wordpiece_dir(xlmr_dir)
    torch.manual_seed(4)
    xlmr = scale_(transformers.XLMRobertaForSequenceClassification(_encoder_config(
        transformers.XLMRobertaConfig, vocab, type_vocab_size=1, num_labels=2)).eval())
    xlmr.save_pretrained(xlmr_dir)
    with torch.no_grad():
        logits = np.concatenate([xlmr(torch.tensor([tok(t)["input_ids"]])).logits.numpy() for t in TEXTS])
    probs = np.stack([o.outputs.data for o in LLM(model=xlmr_dir, **dict(ENGINE, max_num_batched_tokens=48))
                      .classify(TEXTS)])
    want = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(probs, want / want.sum(-1, keepdims=True), atol=1e-5)


# --- pooling beside the engine's other features (tiny random decoders, mean pooling over chunked prompts) ---

def _pool_family(name: str):
    from tests.conftest import tiny_config

    base = tiny_config(max_position_embeddings=128)
    return {"dense": base,
            "sliding": base.replace(architecture="MistralForCausalLM", sliding_window=8),
            "moe": base.replace(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, moe_router="softmax_topk")}[name]


# feature -> (engine options, the family, options the reference engine shares: what changes the model's numbers)
POOL_FEATURES = {
    "no_overlap": (dict(async_scheduling=False), "dense", {}),
    "ngram": (dict(speculative_method="ngram", num_speculative_tokens=3), "dense", {}),
    "int8_kv": (dict(kv_cache_dtype="int8"), "dense", dict(kv_cache_dtype="int8")),
    # A pool of one longest sequence: prompts are preempted mid-way, swapped out and back, or started again at 0.
    "swap": (dict(kv_offload_bytes=2**22, preemption_mode="swap", num_pages=16), "dense", {}),
    "recompute": (dict(num_pages=16), "dense", {}),
    "pp2": (dict(pipeline_parallel_size=2, num_microbatches=2), "dense", {}),
    "sliding": ({}, "sliding", {}),
    "moe": ({}, "moe", {}),
}


@pytest.mark.parametrize("feature", list(POOL_FEATURES))
def test_pooling_beside_each_engine_feature_equals_the_plain_engine(feature):
    """Mean-pooled prompts (chunked over steps of 16 tokens) and greedy generations sharing the steps give what
    the plain engine of the same model gives: embeddings within 1e-5, the same tokens."""
    import jax
    from model.params import init_params

    options, family, shared = POOL_FEATURES[feature]
    cfg = _pool_family(family)
    params = init_params(cfg, jax.random.key(7))
    shape = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=64, max_model_len=64,
                 runner="pooling", pooler_config='{"pooling_type": "MEAN"}', compilation_cache_dir="")
    rng = np.random.default_rng(11)
    pooled = {f"p{i}": rng.integers(3, 97, n).tolist() for i, n in enumerate((9, 23, 31, 40))}
    generated = {f"g{i}": rng.integers(3, 97, n).tolist() for i, n in enumerate((6, 17))}
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(engine_options):
        engine = LLM(config=cfg, params=params, **{**shape, **engine_options}).engine
        for name, ids in generated.items():
            engine.add_request(name, ids, greedy)
        for name, ids in pooled.items():
            engine.add_request(name, ids, pooling_sampling_params(), part_args={"pooling": PoolingParams()})
        done = run_to_completion(engine)
        assert engine.block_manager.num_used_blocks == 0
        if engine_options.get("num_pages"):
            assert engine.stats().num_preemptions > 0  # (what the small pool is for)
        return done

    want, got = run(shared), run(options)
    for name in generated:
        assert got[name].outputs[0].token_ids == want[name].outputs[0].token_ids, name
    for name in pooled:
        np.testing.assert_allclose(got[name].pooled, want[name].pooled, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_lora_adapter_on_an_encoder_matches_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from serving.features.lora import LoRARequest
    from tests.test_pooling_models import _encoder_config, _wordpiece_dir

    hf_dir, adapter_dir = str(tmp_path / "bert"), str(tmp_path / "adapter")
    tok, vocab = _wordpiece_dir(hf_dir)
    torch.manual_seed(2)
    hf = scale_(transformers.BertModel(_encoder_config(transformers.BertConfig, vocab)).eval())
    hf.save_pretrained(hf_dir)
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                      target_modules=["query", "value", "intermediate.dense"]))
    adapted.save_pretrained(adapter_dir)
    with torch.no_grad():  # a BertModel without sentence-transformers files pools its CLS token
        ref = np.stack([adapted(**tok(t, return_tensors="pt")).last_hidden_state[0, 0].numpy() for t in TEXTS])
    llm = LLM(model=hf_dir, enable_lora=True, max_lora_rank=4, **ENGINE)
    got = np.stack([o.outputs.data for o in llm.embed(TEXTS, lora_request=LoRARequest("a", 1, adapter_dir))])
    base = np.stack([o.outputs.data for o in llm.embed(TEXTS)])
    assert cosine_distance(got, ref).max() < 1e-5 and cosine_distance(base, ref).min() > 1e-3


# --- fuzzing the pooling routes from the server's own OpenAPI schema ---

POOLING_FUZZED = [("embed", "/v1/embeddings"), ("embed", "/pooling"), ("rerank", "/score"), ("rerank", "/rerank"),
                  ("rerank", "/classify")]


@pytest.mark.parametrize("which,path", POOLING_FUZZED, ids=[p for _, p in POOLING_FUZZED])
def test_fuzzed_pooling_requests_never_get_a_5xx_and_free_every_page(embed_server, rerank_server, which, path):
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    thread, served = (embed_server[0], "tiny-embed") if which == "embed" else (rerank_server[0], "tiny-rerank")
    llm = (embed_server[1] if which == "embed" else rerank_server[1])[-1]
    schema = schemathesis.openapi.from_dict(httpx.get(thread.url + "/openapi.json", timeout=30).json())
    session, statuses = requests.Session(), []

    def named(case):  # past the model check, to the fields behind it
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = served
        return case

    for mode in ("positive", "negative"):
        strategy = schema[path]["POST"].as_strategy(schemathesis.GenerationMode(mode)).map(named)

        @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def fuzz(case):
            r = case.call(base_url=thread.url, session=session, headers={"authorization": f"Bearer {KEY}"}, timeout=120)
            statuses.append(r.status_code)
            assert r.status_code < 500, (r.status_code, r.text[:500], case.body)
            if r.status_code >= 400:
                assert set(r.json()["error"]) >= {"message", "type", "param", "code"}, r.text[:500]

        fuzz()
    assert len(statuses) >= 15 and 200 in statuses, statuses
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.requests


def test_the_embedded_causal_model_pools_under_runner_pooling_and_still_generates():
    """runner=pooling on a Ridgeline checkpoint (the embedded model): last-token embeddings (the hidden state
    after the final norm, what the model's head reads), beside generation in the same engine."""
    llm = LLM(runner="pooling", max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, compilation_cache_dir="")
    alone = [o.outputs.data for o in llm.embed(TEXTS)]
    assert alone[0].shape == (llm.config.hidden_size,) and not np.allclose(alone[0], alone[1])
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    want = llm.generate(TEXTS[:2], greedy)
    both = llm.generate(TEXTS[:2] + TEXTS, [greedy] * 2 + [pooling_sampling_params()] * len(TEXTS),
                        pooling_params=[None, None] + [PoolingParams()] * len(TEXTS))
    assert [o.outputs[0].token_ids for o in both[:2]] == [o.outputs[0].token_ids for o in want]
    for out, ref in zip(both[2:], alone):
        np.testing.assert_allclose(out.pooled, ref, rtol=1e-5, atol=1e-5)
