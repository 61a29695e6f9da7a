"""Pooling models against their references: poolers (`model.pooling`), decoder embedders and
sequence classifiers (`model.pooling_heads`), and the sentence-transformers pooling config
(`serving.features.pooling_config`).

Tiny random checkpoints are saved by transformers / sentence-transformers on the spot (no
downloads). Embeddings must match `SentenceTransformer.encode` within 1e-5 cosine distance and
classifier scores transformers' logits within 1e-5, all in fp32.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import pooling
from model.cache import init_cache, pack_batch
from model.pooling_heads import final_hidden, load_decoder, score_logits
from serving.features.pooling_config import PoolingConfig, PoolingConfigError, load_pooling_config
from tests.hf_tokenizer_styles import save_style

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COS_TOL, SCORE_TOL = 1e-5, 1e-5
TEXTS = ["the quick brown fox", "The capital of France is Paris.", "naïve café", "def f(x): return x"]
PAGE_SIZE, NUM_PAGES, NUM_TOKENS, MAX_SEQS, PAGES_PER_SEQ = 4, 64, 64, 4, 16


def cosine_distance(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return 1 - np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def scale_(model, seed=0):
    """Weights large enough that a wrong layout shows (HF's init makes every output nearly equal)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "weight" in name and "norm" in name.lower() else 0.0)
                        + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
    return model


# --- poolers ---

def _ragged(rng, lens, dim=8):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1])
    hidden = rng.standard_normal((total + 5, dim)).astype(np.float32)  # 5 padding rows
    return hidden, cu


def test_packed_last_and_first_token_equal_per_sequence():
    rng = np.random.default_rng(0)
    lens = [5, 1, 7, 3]
    hidden, cu = _ragged(rng, lens)
    last = np.asarray(pooling.pool_last_packed(jnp.asarray(hidden), jnp.asarray(cu)))
    first = np.asarray(pooling.pool_first_packed(jnp.asarray(hidden), jnp.asarray(cu)))
    for i, rows in enumerate(pooling.split_rows(hidden, cu, len(lens))):
        assert rows.shape[0] == lens[i]
        np.testing.assert_array_equal(last[i], rows[-1])
        np.testing.assert_array_equal(first[i], rows[0])
    seg = np.asarray(pooling.segment_ids(jnp.asarray(cu), hidden.shape[0]))
    assert seg.tolist() == [0] * 5 + [1] + [2] * 7 + [3] * 3 + [4] * 5


def test_chunked_mean_accumulator_equals_one_shot_mean():
    rng = np.random.default_rng(1)
    lens = [9, 4, 6]
    hidden, cu = _ragged(rng, lens)
    seqs = pooling.split_rows(hidden, cu, len(lens))
    one_shot = np.asarray(pooling.pool_mean_packed(jnp.asarray(hidden), jnp.asarray(cu)))
    for i, rows in enumerate(seqs):
        np.testing.assert_allclose(one_shot[i], rows.mean(0), rtol=1e-6, atol=1e-6)
    # The same prompts prefilled over three steps of different chunk sizes, packed together.
    chunks = [(4, 3, 2), (1, 2, 1), (2, 2, 2)]
    acc_sum, acc_count, start = None, None, [0, 0, 0]
    for k in range(3):
        parts = [seqs[i][start[i]:start[i] + chunks[i][k]] for i in range(3)]
        step_cu = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int32)
        step = np.concatenate(parts + [np.full((3, hidden.shape[1]), 7.0, np.float32)])  # padding rows
        acc_sum, acc_count = pooling.mean_accumulate(jnp.asarray(step), jnp.asarray(step_cu), acc_sum, acc_count)
        start = [s + c[k] for s, c in zip(start, chunks)]
    assert np.asarray(acc_count).tolist() == lens
    np.testing.assert_allclose(np.asarray(pooling.mean_finish(acc_sum, acc_count)), one_shot, rtol=1e-6, atol=1e-6)


def test_dense_poolers_normalize_and_truncate():
    rng = np.random.default_rng(2)
    hidden = rng.standard_normal((2, 5, 6)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    mean = np.asarray(pooling.pool_dense(jnp.asarray(hidden), jnp.asarray(mask), "mean"))
    np.testing.assert_allclose(mean[0], hidden[0, :3].mean(0), rtol=1e-6)
    last = np.asarray(pooling.pool_dense(jnp.asarray(hidden), jnp.asarray(mask), "last"))
    np.testing.assert_array_equal(last, np.stack([hidden[0, 2], hidden[1, 4]]))
    cls = np.asarray(pooling.pool_dense(jnp.asarray(hidden), jnp.asarray(mask), "cls"))
    np.testing.assert_array_equal(cls, hidden[:, 0])
    out = np.asarray(pooling.finish_embedding(jnp.asarray(mean), normalize_output=True, dimensions=4))
    assert out.shape == (2, 4)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out[0] / out[0, 0], mean[0, :4] / mean[0, 0], rtol=1e-5)
    with pytest.raises(ValueError, match="dimensions"):
        pooling.truncate(jnp.asarray(mean), 7)


# --- the pooling config ---

def _write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)


def test_pooling_config_older_layout_as_qwen3_embedding_publishes_it(tmp_path):
    d = str(tmp_path)
    _write(f"{d}/config.json", {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 16})
    _write(f"{d}/modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
    _write(f"{d}/1_Pooling/config.json", {"word_embedding_dimension": 16, "pooling_mode_cls_token": False,
                                          "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                                          "pooling_mode_lasttoken": True, "include_prompt": True})
    _write(f"{d}/sentence_bert_config.json", {"max_seq_length": 8192, "do_lower_case": False})
    cfg = load_pooling_config(d)
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length, cfg.embedding_dimension) == ("last", True, 8192, 16)
    assert not cfg.is_matryoshka
    with pytest.raises(PoolingConfigError, match="matryoshka"):
        cfg.check_dimensions(8, 16)
    over = cfg.with_overrides({"pooling_type": "MEAN", "normalize": False})
    assert (over.pooling_type, over.normalize, over.source) == ("mean", False, "pooler_config")
    with pytest.raises(PoolingConfigError, match="unknown"):
        cfg.with_overrides({"pooling": "mean"})


def test_pooling_config_defaults_and_matryoshka(tmp_path):
    d = str(tmp_path)
    _write(f"{d}/config.json", {"architectures": ["BertModel"], "matryoshka_dimensions": [4, 8, 16]})
    cfg = load_pooling_config(d)
    assert (cfg.pooling_type, cfg.normalize, cfg.is_matryoshka) == ("cls", False, True)
    assert cfg.check_dimensions(8, 16) == 8 and cfg.check_dimensions(None, 16) is None
    with pytest.raises(PoolingConfigError, match="not one of"):
        cfg.check_dimensions(5, 16)
    assert PoolingConfig().pooling_type == "last"


# --- decoders: a Qwen3 embedder and sequence classifiers ---

def _decoder_rows(cfg, params, prompts):
    """Final hidden states of every prompt's tokens, all prompts packed into one ragged step."""
    cache = init_cache(cfg, NUM_PAGES, PAGE_SIZE)
    tables = [list(range(i * PAGES_PER_SEQ, (i + 1) * PAGES_PER_SEQ)) for i in range(len(prompts))]
    tokens, md = pack_batch([(p, 0, tables[i]) for i, p in enumerate(prompts)], page_size=PAGE_SIZE,
                            num_pages=NUM_PAGES, num_tokens=NUM_TOKENS, max_seqs=MAX_SEQS,
                            pages_per_seq=PAGES_PER_SEQ)
    run = jax.jit(final_hidden, static_argnames=("cfg", "backend"))
    hidden, _ = run(params, cache, tokens, md, cfg, backend="reference")
    return hidden, md


def _qwen3_config(**kw):
    return transformers.Qwen3Config(vocab_size=kw.pop("vocab_size"), hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=128, **kw)


def test_qwen3_last_token_embedder_matches_sentence_transformers(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    hf_dir, st_dir = str(tmp_path / "hf"), str(tmp_path / "st")
    save_style("bytelevel_nobos", hf_dir)
    with open(f"{hf_dir}/tokenizer_config.json") as f:
        conf = json.load(f)
    conf.pop("chat_template", None)  # with a template, sentence-transformers 6 encodes texts as chat messages
    with open(f"{hf_dir}/tokenizer_config.json", "w") as f:  # and it pads its batches
        json.dump({**conf, "pad_token": "<|endoftext|>"}, f)
    vocab = transformers.AutoTokenizer.from_pretrained(hf_dir).vocab_size + 8
    torch.manual_seed(0)
    scale_(transformers.Qwen3Model(_qwen3_config(vocab_size=vocab)).eval()).save_pretrained(hf_dir)
    module = Transformer(hf_dir, max_seq_length=64)
    model = st.SentenceTransformer(modules=[module, Pooling(32, pooling_mode="lasttoken"),
                                            Normalize()], device="cpu")
    model.save(st_dir)
    ref = st.SentenceTransformer(st_dir, device="cpu").encode(TEXTS, convert_to_numpy=True)

    pcfg = load_pooling_config(st_dir)
    assert (pcfg.pooling_type, pcfg.normalize) == ("last", True)
    cfg, params, score, _ = load_decoder(st_dir)
    assert score is None
    tok = transformers.AutoTokenizer.from_pretrained(st_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    hidden, md = _decoder_rows(cfg, params, prompts)
    ours = pooling.finish_embedding(pooling.pool_last_packed(hidden, md.cu_q_lens)[:len(TEXTS)],
                                    normalize_output=pcfg.normalize)
    dist = cosine_distance(ours, ref)
    print("qwen3 embedder max cosine distance", dist.max())
    assert dist.max() < COS_TOL
    np.testing.assert_allclose(np.linalg.norm(np.asarray(ours), axis=-1), 1.0, rtol=1e-5)


def test_decoder_mean_over_prefill_chunks_equals_one_shot(tmp_path):
    """A Qwen3 base model's mean pooling with the prompts prefilled in two steps through the paged
    cache (the accumulator carried between them) equals the one-step mean, and transformers' mean."""
    hf_dir = str(tmp_path / "hf")
    torch.manual_seed(5)
    hf = scale_(transformers.Qwen3Model(_qwen3_config(vocab_size=97)).eval())
    hf.save_pretrained(hf_dir)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(1, 97, n).tolist() for n in (11, 6, 9)]
    cfg, params, _, _ = load_decoder(hf_dir)
    hidden, md = _decoder_rows(cfg, params, prompts)
    one_shot = np.asarray(pooling.pool_mean_packed(hidden, md.cu_q_lens))[:3]
    cache = init_cache(cfg, NUM_PAGES, PAGE_SIZE)
    tables = [list(range(i * PAGES_PER_SEQ, (i + 1) * PAGES_PER_SEQ)) for i in range(3)]
    run = jax.jit(final_hidden, static_argnames=("cfg", "backend"))
    acc_sum = acc_count = None
    for lo, hi in ((0, 5), (5, None)):
        tokens, step = pack_batch([(p[lo:hi], lo, tables[i]) for i, p in enumerate(prompts)], page_size=PAGE_SIZE,
                                  num_pages=NUM_PAGES, num_tokens=NUM_TOKENS, max_seqs=MAX_SEQS,
                                  pages_per_seq=PAGES_PER_SEQ)
        rows, cache = run(params, cache, tokens, step, cfg, backend="reference")
        acc_sum, acc_count = pooling.mean_accumulate(rows, step.cu_q_lens, acc_sum, acc_count)
    chunked = np.asarray(pooling.mean_finish(acc_sum, acc_count))[:3]
    assert np.asarray(acc_count)[:3].tolist() == [len(p) for p in prompts]
    with torch.no_grad():
        ref = np.stack([hf(torch.tensor([p])).last_hidden_state[0].mean(0).numpy() for p in prompts])
    print("chunked vs one-shot mean", np.abs(chunked - one_shot).max(), "vs transformers", np.abs(chunked - ref).max())
    np.testing.assert_allclose(chunked, one_shot, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,num_labels", [("Qwen3ForSequenceClassification", 1),
                                              ("LlamaForSequenceClassification", 3)])
def test_decoder_sequence_classifier_matches_transformers(tmp_path, arch, num_labels):
    hf_dir = str(tmp_path / "hf")
    torch.manual_seed(1)
    if arch.startswith("Qwen3"):
        config = _qwen3_config(vocab_size=97, num_labels=num_labels, pad_token_id=0)
    else:
        config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          num_labels=num_labels, pad_token_id=0)
    hf = scale_(getattr(transformers, arch)(config).eval())
    hf.save_pretrained(hf_dir)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 97, n).tolist() for n in (7, 3, 12, 5)]
    with torch.no_grad():
        ref = np.concatenate([hf(torch.tensor([p])).logits.float().numpy() for p in prompts])
    cfg, params, score, _ = load_decoder(hf_dir)
    assert score.weight.shape == (num_labels, 32) and score.num_labels == num_labels
    hidden, md = _decoder_rows(cfg, params, prompts)
    ours = np.asarray(score_logits(pooling.pool_last_packed(hidden, md.cu_q_lens)[:len(prompts)], score.weight))
    diff = np.abs(ours - ref).max()
    print(arch, "max |score diff|", diff)
    assert ours.shape == (len(prompts), num_labels) and diff < SCORE_TOL


# --- encoders: BERT and XLM-RoBERTa embedders, cross-encoder rerankers ---

def _wordpiece_dir(directory):
    """A tiny BERT WordPiece tokenizer (lower-cased letters, their `##` pieces, a few words), padding id 1."""
    import string

    from model.families import bert  # noqa: F401  (the encoders module must import)

    words = sorted({w for t in TEXTS for w in t.lower().replace(".", " ").replace(":", " ").split()})
    pieces = list(string.ascii_lowercase) + ["##" + c for c in string.ascii_lowercase] + list(".,:()") + words
    vocab = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"] + list(dict.fromkeys(pieces))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizerFast(os.path.join(directory, "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(directory)
    return tok, len(vocab)


def _encoder_config(cls, vocab, **kw):
    return cls(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64, pad_token_id=1, **kw)


def _run_encoder(directory, batch, token_types=True):
    from model.families.bert import encoder_forward
    from model.pooling_heads import load_encoder

    cfg, weights = load_encoder(directory)
    types = jnp.asarray(batch["token_type_ids"]) if token_types and "token_type_ids" in batch else None
    hidden = jax.jit(encoder_forward, static_argnames="cfg")(weights, jnp.asarray(batch["input_ids"]),
                                                            jnp.asarray(batch["attention_mask"]), cfg, types)
    return cfg, weights, hidden


def save_encoder_embedder(tmp_path, arch: str, mode: str) -> str:
    """A tiny random `arch` encoder with a WordPiece tokenizer, saved by sentence-transformers with `mode` pooling
    and Normalize (max_seq_length 48); its directory."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    hf_dir, st_dir = str(tmp_path / "hf"), str(tmp_path / "st")
    _, vocab = _wordpiece_dir(hf_dir)
    torch.manual_seed(2)
    config_cls = transformers.BertConfig if arch == "BertModel" else transformers.XLMRobertaConfig
    extra = {} if arch == "BertModel" else {"type_vocab_size": 1}
    scale_(getattr(transformers, arch)(_encoder_config(config_cls, vocab, **extra)).eval()).save_pretrained(hf_dir)
    st.SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=48), Pooling(32, pooling_mode=mode),
                                    Normalize()], device="cpu").save(st_dir)
    return st_dir


def save_bert_cross_encoder(hf_dir: str):
    """A tiny random one-label `BertForSequenceClassification` (a cross-encoder); (its tokenizer, the model)."""
    tok, vocab = _wordpiece_dir(hf_dir)
    torch.manual_seed(3)
    hf = scale_(transformers.BertForSequenceClassification(_encoder_config(transformers.BertConfig, vocab,
                                                                          num_labels=1)).eval())
    hf.save_pretrained(hf_dir)
    return tok, hf


@pytest.mark.parametrize("arch,mode", [("BertModel", "mean"), ("XLMRobertaModel", "cls")])
def test_encoder_embedder_matches_sentence_transformers(tmp_path, arch, mode):
    st = pytest.importorskip("sentence_transformers")
    st_dir = save_encoder_embedder(tmp_path, arch, mode)
    ref = st.SentenceTransformer(st_dir, device="cpu").encode(TEXTS, convert_to_numpy=True)

    pcfg = load_pooling_config(st_dir)
    assert (pcfg.pooling_type, pcfg.normalize, pcfg.max_seq_length) == (mode, True, 48)  # the 6.x layout
    batch = transformers.AutoTokenizer.from_pretrained(st_dir)(TEXTS, padding=True, return_tensors="np")
    _, _, hidden = _run_encoder(st_dir, batch)
    ours = pooling.finish_embedding(pooling.pool_dense(hidden, jnp.asarray(batch["attention_mask"]), pcfg.pooling_type),
                                    normalize_output=pcfg.normalize)
    dist = cosine_distance(ours, ref)
    print(arch, "max cosine distance", dist.max())
    assert dist.max() < COS_TOL
    # Matryoshka: sentence-transformers' truncate_dim against `dimensions`.
    short = st.SentenceTransformer(st_dir, device="cpu", truncate_dim=16).encode(TEXTS, convert_to_numpy=True)
    ours16 = pooling.finish_embedding(pooling.pool_dense(hidden, jnp.asarray(batch["attention_mask"]),
                                                         pcfg.pooling_type), normalize_output=True, dimensions=16)
    assert ours16.shape == (len(TEXTS), 16) and cosine_distance(ours16, short).max() < COS_TOL


def test_bert_cross_encoder_matches_cross_encoder_predict(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from model.families.bert import classifier_logits

    hf_dir = str(tmp_path / "hf")
    tok, hf = save_bert_cross_encoder(hf_dir)
    pairs = [(TEXTS[0], TEXTS[1]), (TEXTS[0], TEXTS[2]), (TEXTS[3], TEXTS[1])]
    ref = st.CrossEncoder(hf_dir, device="cpu").predict(pairs)
    batch = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="np")
    assert batch["token_type_ids"].max() == 1  # the second text is segment 1
    cfg, weights, hidden = _run_encoder(hf_dir, batch)
    logits = np.asarray(classifier_logits(weights, hidden, cfg))
    with torch.no_grad():
        hf_logits = hf(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()
    ours = 1 / (1 + np.exp(-logits[:, 0]))  # CrossEncoder's default activation for one label: a sigmoid
    print("cross-encoder max |score diff|", np.abs(ours - ref).max(), "logits", np.abs(logits - hf_logits).max())
    assert np.abs(ours - ref).max() < SCORE_TOL and np.abs(logits - hf_logits).max() < SCORE_TOL


def test_xlm_roberta_classifier_matches_transformers(tmp_path):
    from model.families.bert import classifier_logits

    hf_dir = str(tmp_path / "hf")
    torch.manual_seed(4)
    config = _encoder_config(transformers.XLMRobertaConfig, 60, type_vocab_size=1, num_labels=2)
    hf = scale_(transformers.XLMRobertaForSequenceClassification(config).eval())
    hf.save_pretrained(hf_dir)
    rng = np.random.default_rng(5)
    lens = (9, 4, 12)
    ids = np.ones((3, 12), np.int64)  # padding id 1 on the right
    for i, n in enumerate(lens):
        ids[i, :n] = np.concatenate([[0], rng.integers(5, 60, n - 2), [2]])
    mask = (ids != 1).astype(np.int64)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    cfg, weights, hidden = _run_encoder(hf_dir, {"input_ids": ids, "attention_mask": mask})
    assert cfg.positions_after_padding and cfg.num_labels == 2
    ours = np.asarray(classifier_logits(weights, hidden, cfg))
    print("xlm-r classifier max |logit diff|", np.abs(ours - ref).max())
    assert np.abs(ours - ref).max() < SCORE_TOL
