"""Gemma 3 multimodal against transformers: a tiny random `Gemma3ForConditionalGeneration` written by
transformers, converted by `model.convert_hf`, run on images made here.

Model layer:
* preprocessing (`model.vision.gemma3_processor`): pixel values equal to the checkpoint's processor
  (`Gemma3ImageProcessorPil`, pan-and-scan off) for an RGB array and an RGBA PIL image;
* the SigLIP encoder and projector (`model.vision.gemma3_siglip`): image features within 1e-4 of
  `get_image_features`;
* the decoder attending among an image's 16 tokens both ways (with an 8-token sliding window that
  clips the image, as transformers combines them): prompt log-probabilities within 1e-4, in one call and
  in chunks that keep the image whole; 16 greedy tokens identical to `generate`; and a causal mask over
  the image breaks parity (the test is of the bidirectional mask).

Engine (`LLM`, 16-token steps, so a chunk would cut the image if the scheduler let it): greedy tokens
equal transformers' for a batch; the prefix cache shares the pages of a repeated image (a hit that ends
inside the image, whose rest is then prefilled) and none of an image that differs; nothing recompiles
after warm-up; preempted requests get the tokens of their runs alone; an image larger than a step is
refused; TP=2 gives transformers' tokens too, and int8 weights prompt log-probabilities near them;
`LLM.chat`'s prompt ids are those of transformers' `Gemma3Processor` (with a Gemma 3-style tokenizer
and chat template written beside the checkpoint); on that processor's outputs, greedy tokens equal
`generate`'s for two images of different sizes before the text, two of one size, and images between
pieces of text; and a model that generates the image soft token embeds it as a token, as transformers does.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from model.cache import init_cache, pack_batch  # noqa: E402
from model.forward import forward_jit  # noqa: E402
from model.vision.gemma3_processor import preprocess  # noqa: E402
from model.vision.gemma3_siglip import encode_jit  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.core import model_runner  # noqa: E402
from serving.core.sampling_params import InvalidParameterError  # noqa: E402
from test_hf_parity import save_and_convert, scale_weights_  # noqa: E402

TOL = 1e-4
IMAGE_ID, BOI, EOI = 290, 288, 289
IMAGE_TOKENS = 16
NEW_TOKENS = 16
PAGE_SIZE, NUM_PAGES, NUM_TOKENS, PAGES_PER_SEQ = 8, 32, 64, 8
TEXT = [2, 17, 33, 250, 12, 13, 14, 15, 16, 18]  # a full text-only first page, then the image
TAIL = [EOI, 9, 80, 120, 7, 64]


def make_images():
    rng = np.random.default_rng(7)
    rgb = rng.integers(0, 256, (150, 210, 3), dtype=np.uint8)
    other = rgb.copy()
    other[40:110, 60:150] = 255 - other[40:110, 60:150]  # the same image but for a block in its middle
    rgba = Image.fromarray(rng.integers(0, 256, (60, 90, 4), dtype=np.uint8), "RGBA")
    return rgb, other, rgba


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                         query_pre_attn_scalar=16, bos_token_id=2, eos_token_id=1, pad_token_id=0),
        # 56 / 7: an 8 x 8 patch grid pooled 2 x 2 into 16 soft tokens.
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=7, vision_use_head=False),
        mm_tokens_per_image=IMAGE_TOKENS, image_token_index=IMAGE_ID, boi_token_index=BOI, eoi_token_index=EOI)
    for c in (cfg, cfg.vision_config, cfg.text_config):
        c._attn_implementation = "eager"
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    # A small embedding: Gemma scales it by sqrt(hidden), and larger ones make every continuation
    # repeat the prompt's last token whatever the image.
    scale_weights_(model, norm_center=0.0, bias_std=0.5, embed_std=0.05)
    processor = transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})

    def after_save(directory):
        processor.save_pretrained(directory)
        save_tokenizer(directory)

    hf_dir, out_dir, ours_cfg, params = save_and_convert(model, tmp_path_factory, "gemma3_vl", after_save=after_save)
    return model, processor, ours_cfg, params, out_dir, hf_dir


# A Gemma 3-style chat template: an image part is `<start_of_image>`, each text part trimmed.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}{% elif item['type'] == 'text' %}"
    "{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def save_tokenizer(directory):
    """A Gemma 3-style tokenizer that fits the model's 300 ids: Gemma's first specials, the 256 byte
    tokens, a few letters and merges (one of them the blank line, "\n\n", so where the processor's
    blank lines are tokenized shows), then begin-of-image, end-of-image and the soft token at 288-290."""
    import json
    import os

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    for ch in "\n\u2581adehilmnorsuw":
        vocab[ch] = len(vocab)
    merges = [("\n", "\n"), ("h", "i"), ("a", "n"), ("an", "d"), ("u", "s"), ("us", "e"), ("use", "r"),
              ("m", "o"), ("mo", "d"), ("mod", "e"), ("mode", "l")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    images = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    assert len(vocab) == BOI
    vocab.update({t: BOI + i for i, t in enumerate(images)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials + images])
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(os.path.join(directory, "tokenizer.json"))
    conf = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
            "extra_special_tokens": dict(zip(("boi_token", "eoi_token", "image_token"), images))}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f)


def hf_pixels(processor, images):
    return processor(images=images, return_tensors="np")["pixel_values"]


def test_config_reads_vision_and_tokens(built):
    _, _, cfg, _, _, _ = built
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.image_token_id == IMAGE_ID
    v = cfg.vision
    assert v.bidirectional and v.tokens_per_image == IMAGE_TOKENS and v.image_size == 56 and v.depth == 2
    assert v.image_prompt_ids == (BOI, IMAGE_ID, EOI) and v.image_mean == (0.5, 0.5, 0.5)
    assert cfg.sliding_window == 8 and cfg.qk_norm


def test_pixel_values_equal_processor(built):
    _, processor, cfg, _, _, _ = built
    for image in make_images():
        got = preprocess(image, cfg.vision)
        np.testing.assert_array_equal(got.patches, hf_pixels(processor, [image])[0])
        assert got.num_tokens == IMAGE_TOKENS


def our_features(cfg, params, image):
    return np.asarray(encode_jit(params.vision, preprocess(image, cfg.vision).patches, cfg.vision))


def test_image_features_match(built):
    model, processor, cfg, params, _, _ = built
    for image in make_images():
        with torch.no_grad():
            want = model.model.get_image_features(torch.tensor(hf_pixels(processor, [image]))).pooler_output[0].numpy()
        got = our_features(cfg, params, image)
        assert got.shape == want.shape == (IMAGE_TOKENS, cfg.hidden_size)
        assert np.abs(got - want).max() < TOL * max(1.0, np.abs(want).max())


def make_prompt() -> list[int]:
    return TEXT + [BOI] + [IMAGE_ID] * IMAGE_TOKENS + TAIL


def hf_logprobs(model, processor, image, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=torch.tensor(hf_pixels(processor, [image])),
                       token_type_ids=(ids == IMAGE_ID).long()).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


class Runner:
    """One sequence through `model.forward` with image embeddings and span ends as step inputs."""

    def __init__(self, cfg, params, prompt, features, causal_images=False):
        self.cfg, self.params, self.features = cfg, params, features
        self.cache = init_cache(cfg, NUM_PAGES, PAGE_SIZE)
        self.table = np.random.default_rng(3).permutation(NUM_PAGES)[:PAGES_PER_SEQ].tolist()
        self.image_start = prompt.index(IMAGE_ID)
        self.causal_images = causal_images

    def step(self, ids, start):
        tokens, md = pack_batch([(ids, start, self.table)], page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                                num_tokens=NUM_TOKENS, max_seqs=2, pages_per_seq=PAGES_PER_SEQ,
                                logits_rows=NUM_TOKENS, all_logits=True)
        embeds = np.zeros((NUM_TOKENS, self.cfg.hidden_size), np.float32)
        span_end = np.zeros(NUM_TOKENS, np.int32)
        for row in range(len(ids)):
            k = start + row - self.image_start
            if 0 <= k < len(self.features) and ids[row] == IMAGE_ID:
                embeds[row] = self.features[k]
                span_end[row] = 0 if self.causal_images else self.image_start + len(self.features)
        md = dataclasses.replace(md, span_end=span_end)
        logits, self.cache = forward_jit(self.params, self.cache, tokens, md, self.cfg, backend="xla",
                                         image_embeds=embeds)
        return np.asarray(logits)[:len(ids)]


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("chunks", [(None,), (11, IMAGE_TOKENS + 3, None)], ids=["one_call", "chunks_around_the_image"])
def test_prompt_logprobs_match(built, chunks):
    """In chunks as the scheduler cuts them: up to the image, the image whole with a few tokens after it,
    the rest."""
    model, processor, cfg, params, _, _ = built
    image = make_images()[0]
    prompt = make_prompt()
    want = hf_logprobs(model, processor, image, prompt)
    runner = Runner(cfg, params, prompt, our_features(cfg, params, image))
    got, start = [], 0
    for size in chunks:
        size = len(prompt) - start if size is None else size
        got.append(runner.step(prompt[start:start + size], start))
        start += size
    assert np.abs(_log_softmax(np.concatenate(got)) - want).max() < TOL
    # A causal mask over the image is not what transformers computes: the test sees the mask.
    causal = Runner(cfg, params, prompt, our_features(cfg, params, image), causal_images=True)
    assert np.abs(_log_softmax(causal.step(prompt, 0)) - want).max() > 100 * TOL


def hf_generate(model, processor, images, ids):
    t = torch.tensor([ids])
    kw = {}
    if images:
        kw = dict(pixel_values=torch.tensor(hf_pixels(processor, images)), token_type_ids=(t == IMAGE_ID).long())
    with torch.no_grad():
        out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                             **kw)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_match_generate(built):
    model, processor, cfg, params, _, _ = built
    image = make_images()[2]
    prompt = make_prompt()
    want = hf_generate(model, processor, [image], prompt)
    runner = Runner(cfg, params, prompt, our_features(cfg, params, image))
    got = [int(np.argmax(runner.step(prompt, 0)[-1]))]
    while len(got) < NEW_TOKENS:
        got.append(int(np.argmax(runner.step([got[-1]], len(prompt) + len(got) - 1)[-1])))
    assert got == want


# --- the engine ---------------------------------------------------------------------------------------

ENGINE = dict(page_size=PAGE_SIZE, max_model_len=128, num_pages=24, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, min_context_bucket=128, encoder_cache_mb=1)


def request(image, tail=TAIL):
    return {"prompt_token_ids": TEXT + [BOI, IMAGE_ID] + tail, "multi_modal_data": {"image": image}}


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def served(built):
    model, processor, _, _, out_dir, hf_dir = built
    return model, processor, LLM(out_dir, warmup=True, **ENGINE), out_dir, hf_dir


def test_engine_batch_matches_transformers_without_recompiling(served):
    """16-token steps: the first chunk ends before the image (11 tokens, not 16) and the next takes its
    16 tokens whole; images in the steps of other requests' decodes."""
    model, processor, llm, _, _ = served
    a, b, c = make_images()
    before = model_runner.compilation_count()
    steps = []
    llm.engine.stats_log.add_listener(steps.append)
    try:
        outs = llm.generate([request(a), request(c), TEXT + TAIL, request(b)], greedy())
    finally:
        llm.engine.stats_log.remove_listener(steps.append)
    assert model_runner.compilation_count() == before  # warm-up compiled every shape image steps use
    assert steps[0].q_lens[0] == len(TEXT) + 1  # the first chunk stopped before the image (the scheduler's gate)
    for image, out in zip((a, c, None, b), outs):
        ids = list(out.prompt_token_ids)
        assert ids.count(IMAGE_ID) == (IMAGE_TOKENS if image is not None else 0)
        assert list(out.outputs[0].token_ids) == hf_generate(model, processor, [image] if image is not None else [],
                                                             ids)
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids  # the changed block shows
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_pages


def test_preempted_requests_match_their_runs_alone(served):
    """Four image requests of 33 prompt and 40 new tokens need 40 pages of the pool's 24: some are
    preempted and recomputed (the image prefilled whole again and attended both ways, from its cached
    encoder output), and each gets the greedy tokens it gets alone."""
    _, _, llm, _, _ = served
    a, b, c = make_images()
    reqs = [request(im) for im in (a, b, c, np.ascontiguousarray(a[::-1]))]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [llm.generate([r], sp)[0].outputs[0].token_ids for r in reqs]
    before = llm.engine.scheduler.num_preemptions
    together = [o.outputs[0].token_ids for o in llm.generate(reqs, sp)]
    assert llm.engine.scheduler.num_preemptions > before
    assert together == alone


def test_prefix_cache_hits_inside_a_shared_image_and_never_across_a_different_one(served):
    model, processor, llm, _, _ = served
    a, b, _ = make_images()
    llm.engine.reset_prefix_cache()
    hits = lambda: llm.engine.stats().prefix_cache_hit_tokens  # noqa: E731
    short = TAIL[:3]  # 30 prompt tokens: the last full page before the final token ends inside the image
    first = llm.generate([request(a, short)], greedy())[0]
    h0 = hits()
    other = llm.generate([request(b, short)], greedy())[0]
    assert hits() - h0 == PAGE_SIZE  # only the text-only first page: every later page holds image b
    assert list(other.outputs[0].token_ids) == hf_generate(model, processor, [b], list(other.prompt_token_ids))
    h1 = hits()
    again = llm.generate([request(a, short)], greedy())[0]
    n = len(again.prompt_token_ids)
    # Every full page is reused, the last one ending inside the image (tokens 11-26): the step after the
    # hit starts inside the image and prefills its rest, attending back to the cached part.
    hit = (n - 1) // PAGE_SIZE * PAGE_SIZE
    assert hits() - h1 == hit and 11 < hit < 11 + IMAGE_TOKENS
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(again.outputs[0].token_ids) == hf_generate(model, processor, [a], list(again.prompt_token_ids))


def test_image_larger_than_a_step_is_refused(served):
    _, _, llm, _, _ = served
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)  # 4 logit rows per step < 16 tokens
    with pytest.raises(InvalidParameterError, match="prefilled in one step") as e:
        llm.engine.make_request("big", request(make_images()[0]), sp)
    assert e.value.param == "multi_modal_data"
    assert list(llm.generate([request(make_images()[0])], greedy())[0].outputs[0].token_ids)  # still serving


def test_tensor_parallel_matches_transformers(served):
    """TP=2: the decoder sharded (the span ends reach each device's attention), the encoder replicated."""
    model, processor, _, out_dir, _ = served
    a, _, c = make_images()
    tp = LLM(out_dir, tensor_parallel_size=2, **ENGINE)
    assert len(tp.engine.runner.params.layers[0].wq.sharding.device_set) == 2
    for image, out in zip((a, c), tp.generate([request(a), request(c)], greedy())):
        assert list(out.outputs[0].token_ids) == hf_generate(model, processor, [image], list(out.prompt_token_ids))


def test_int8_weights_stay_near_transformers(served):
    """int8 weights (the decoder's linear layers; the encoder stays float): prompt log-probabilities
    within hundredths of transformers' float ones, not the units a misplaced or causal image moves them."""
    model, processor, _, out_dir, _ = served
    a = make_images()[0]
    # 16 sequences: a step has 16 logit rows, so the prompt log-probabilities of a whole image fit in one
    llm = LLM(out_dir, weight_dtype="int8", **dict(ENGINE, max_num_seqs=16))
    assert llm.config.weight_dtype == "int8" and llm.engine.runner.params.vision.projection.dtype == np.float32
    out = llm.generate([request(a)], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                    prompt_logprobs=0))[0]
    ids = list(out.prompt_token_ids)
    want = hf_logprobs(model, processor, a, ids)
    got = np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])])
    diffs = np.abs(got - want[np.arange(len(ids) - 1), ids[1:]])
    assert 0 < diffs.mean() < 0.2
    assert len(out.outputs[0].token_ids) == NEW_TOKENS


def test_pipeline_stages_match_transformers(served):
    """PP=2 with three microbatches asked for: a step whose image tokens attend both ways runs as one
    microbatch (a boundary inside an image would hide its last tokens from its first), so the spans
    reach every stage and the tokens are transformers' ones."""
    model, processor, llm, out_dir, _ = served
    a, _, c = make_images()
    pp = LLM(out_dir, pipeline_parallel_size=2, num_microbatches=3, **ENGINE)
    assert pp.engine.runner.layout.pipeline_parallel_size == 2
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    one = llm.generate([request(a), request(c)], sp)
    for image, out, ref in zip((a, c), pp.generate([request(a), request(c)], sp), one):
        assert list(out.outputs[0].token_ids) == hf_generate(model, processor, [image], list(out.prompt_token_ids))
        # Greedy tokens of a tiny model can survive a wrong mask; their log-probabilities cannot.
        assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)


def test_chunk_stop_never_cuts_an_image_attended_both_ways():
    from serving.features.multimodal import Encoded, PlacedImage, RequestImages

    enc = Encoded(np.zeros((IMAGE_TOKENS, 4), np.float32), (1, 8, 8))
    images = RequestImages([PlacedImage(b"a", 11, enc), PlacedImage(b"b", 40, enc)], None, 0, bidirectional=True)
    assert images.chunk_stop(0, 16) == 11  # ends before an image that does not fit
    assert images.chunk_stop(11, 27) == 27 and images.chunk_stop(11, 30) == 30  # takes it whole
    assert images.chunk_stop(11, 26) == 11  # at its start without room for it: nothing this step
    assert images.chunk_stop(24, 30) == 30 and images.chunk_stop(24, 26) == 24  # from inside: its rest, or wait
    assert images.chunk_stop(20, 45) == 40  # the second image is cut: end before it
    causal = dataclasses.replace(images, bidirectional=False)
    assert causal.chunk_stop(0, 16) == 16  # Qwen2.5-VL's causal images may be cut anywhere


def test_chat_prompt_is_the_hf_processors(served):
    """`LLM.chat` with two images and text around them gives the ids of transformers' Gemma3Processor
    (the chat template applied, each `<start_of_image>` rewritten to a blank line, begin-of-image, the
    soft tokens, end-of-image and a blank line, then tokenized), and transformers' greedy tokens."""
    model, image_processor, llm, _, hf_dir = served
    a, _, c = make_images()
    conv = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "image": a},
                                         {"type": "text", "text": "and"}, {"type": "image", "image": c},
                                         {"type": "text", "text": "model"}]}]
    processor = transformers.Gemma3Processor(image_processor=image_processor,
                                             tokenizer=transformers.AutoTokenizer.from_pretrained(hf_dir),
                                             chat_template=CHAT_TEMPLATE, image_seq_length=IMAGE_TOKENS)
    hf_conv = [{**conv[0], "content": [p if p["type"] == "text" or not isinstance(p["image"], np.ndarray)
                                       else {"type": "image", "image": Image.fromarray(p["image"])}
                                       for p in conv[0]["content"]]}]
    want = processor.apply_chat_template(hf_conv, add_generation_prompt=True, tokenize=True, return_dict=True)
    want_ids = [int(i) for i in want["input_ids"][0]]
    text = processor.apply_chat_template(hf_conv, add_generation_prompt=True, tokenize=False)
    assert processor(text=text, images=[a, c])["input_ids"][0] == want_ids
    assert want_ids.count(BOI) == 2 and want_ids[want_ids.index(BOI) - 1] == llm.tokenizer.encode(
        "\n\n", add_special_tokens=False)[0]  # the blank line is a token of its own here
    out = llm.chat(conv, greedy())[0]
    assert list(out.prompt_token_ids) == want_ids
    np.testing.assert_array_equal(hf_pixels(image_processor, [a, c]), want["pixel_values"])
    assert list(out.outputs[0].token_ids) == hf_generate(model, image_processor, [a, c], want_ids)


def gemma3_processor(image_processor, hf_dir):
    return transformers.Gemma3Processor(image_processor=image_processor,
                                        tokenizer=transformers.AutoTokenizer.from_pretrained(hf_dir),
                                        chat_template=CHAT_TEMPLATE, image_seq_length=IMAGE_TOKENS)


def chat_cases():
    """Conversations of two images each: of different sizes (150 x 210 RGB, 60 x 90 RGBA; both resized to
    the encoder's 56 x 56) before the text, of one size, and between pieces of text."""
    a, other, c = (im if isinstance(im, Image.Image) else Image.fromarray(im) for im in make_images())
    image, text = (lambda im: {"type": "image", "image": im}), (lambda t: {"type": "text", "text": t})
    return {"different_sizes": [image(a), image(c), text("Compare them.")],
            "same_size": [image(a), image(other), text("Compare them.")],
            "between_text": [text("hi"), image(c), text("and"), image(a), text("model")]}


def processor_inputs(processor, content):
    """The processor's prompt ids (soft tokens expanded, blank lines written) and the images in prompt order."""
    want = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)
    return [int(i) for i in want["input_ids"][0]], [part["image"] for part in content if part["type"] == "image"]


def test_images_in_one_chat_match_generate(served):
    """Each case's prompt ids are the processor's; the engine takes them (already expanded) with the
    images and answers with `generate`'s tokens on the processor's pixels."""
    model, image_processor, llm, _, hf_dir = served
    processor = gemma3_processor(image_processor, hf_dir)
    cases = {name: processor_inputs(processor, content) for name, content in chat_cases().items()}
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                         for ids, images in cases.values()], greedy())
    for (name, (ids, images)), out in zip(cases.items(), outs):
        assert ids.count(BOI) == 2 and list(out.prompt_token_ids) == ids, name
        assert list(out.outputs[0].token_ids) == hf_generate(model, image_processor, images, ids), name


def test_generated_soft_token_is_embedded_as_a_token(served, built):
    """A model that generates the image soft token id (made its first greedy token: the tied embedding
    row set to twice the usual first token's) feeds it back as a token, as transformers does: its
    embedding row, not an image's (nor an empty one)."""
    model, image_processor, _, _, hf_dir = served
    cfg, params = built[2], built[3]
    ids, images = processor_inputs(gemma3_processor(image_processor, hf_dir), chat_cases()["different_sizes"])
    first = hf_generate(model, image_processor, images, ids)[0]
    edited = copy.deepcopy(model)
    embed = edited.get_input_embeddings().weight
    assert cfg.tie_word_embeddings and edited.lm_head.weight.data_ptr() == embed.data_ptr()
    with torch.no_grad():
        embed[IMAGE_ID] = 2 * embed[first]
    want = hf_generate(edited, image_processor, images, ids)
    assert want[0] == IMAGE_ID
    table = np.asarray(params.embed).copy()
    table[IMAGE_ID] = 2 * table[first]
    llm = LLM(config=cfg, params=dataclasses.replace(params, embed=jnp.asarray(table)), **ENGINE)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], greedy())[0]
    assert list(out.outputs[0].token_ids) == want


def test_http_chat_prompt_is_the_hf_processors(served):
    """The chat route with two `data:` URL image parts counts the processor's prompt ids (the blank lines
    included) and answers with transformers' greedy tokens. Last in the file: the server takes over the
    shared engine."""
    import base64
    import io
    import json
    import urllib.request

    from serving.server import ServerThread

    model, image_processor, llm, _, hf_dir = served
    a, _, c = make_images()

    def data_url(image):
        buf = io.BytesIO()
        (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(buf, "PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    processor = transformers.Gemma3Processor(image_processor=image_processor,
                                             tokenizer=transformers.AutoTokenizer.from_pretrained(hf_dir),
                                             chat_template=CHAT_TEMPLATE, image_seq_length=IMAGE_TOKENS)
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    want_ids = processor(text=text, images=[a, c])["input_ids"][0]
    want = hf_generate(model, image_processor, [a, c], want_ids)
    body = {"model": "g3", "temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(a)}},
                {"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": data_url(c)}}]}]}
    with ServerThread(llm, model_name="g3") as srv:
        req = urllib.request.Request(srv.url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
    assert reply["usage"]["prompt_tokens"] == len(want_ids)
    assert reply["choices"][0]["message"]["content"] == llm.tokenizer.decode(want)
    assert reply["usage"]["completion_tokens"] == NEW_TOKENS
