"""Image requests through the engine (`serving.features.multimodal`), against transformers' `generate`.

The tiny random Qwen2.5-VL of `test_vision_qwen2_5_vl` is served by `LLM` with a 16-token step budget
(every image's 40 placeholder tokens are cut across prefill chunks) and a KV pool too small for the
batch (so sequences are preempted and recomputed): each request's 16 greedy tokens equal transformers'.
The prefix cache is attacked with two prompts differing only in their image (no page beyond the
text-only first block may be shared) and hit with a repeated image (its pages and its encoder output
are reused); bad image inputs are refused with the field named, before anything is queued.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from serving import LLM, SamplingParams  # noqa: E402
from serving.features.multimodal import Multimodal  # noqa: E402
from serving.core.sampling_params import InvalidParameterError  # noqa: E402
from test_vision_qwen2_5_vl import END_ID, IMAGE_ID, START_ID, build_converted, hf_pixels  # noqa: E402

NEW_TOKENS = 16
PAGE = 8
ENGINE = dict(page_size=PAGE, max_model_len=128, num_pages=18, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, min_context_bucket=128, encoder_cache_mb=1)
TEXT = [1, 17, 33, 250, 12, 13, 14, 15, 16, 18]  # a full text-only first page, then the image
TAIL = [END_ID, 9, 80, 120, 7, 64]


def images():
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, (150, 210, 3), dtype=np.uint8)  # 40 tokens
    b = a.copy()
    b[70:80, 100:110] = 255 - b[70:80, 100:110]  # the same image but for one patch
    c = Image.fromarray(rng.integers(0, 256, (60, 90, 4), dtype=np.uint8), "RGBA")  # 6 tokens
    return a, b, c


def prompt(image):
    return {"prompt_token_ids": TEXT + [START_ID, IMAGE_ID] + TAIL, "multi_modal_data": {"image": image}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, processor, cfg, _, out_dir, _ = build_converted(tmp_path_factory, "qwen2_5_vl_engine")
    llm = LLM(out_dir, **ENGINE)
    return model, processor, llm


def hf_generate(model, processor, image, ids):
    pixels, grid = hf_pixels(processor, [image])
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), pixel_values=torch.tensor(pixels),
                             image_grid_thw=torch.tensor(grid), mm_token_type_ids=(t == IMAGE_ID).int(),
                             do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_batch_chunked_preempted_matches_transformers(served):
    model, processor, llm = served
    a, b, c = images()
    text_only = TEXT + TAIL
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate([prompt(a), prompt(b), text_only, prompt(c)], greedy())
    assert llm.engine.scheduler.num_preemptions > before  # the pool cannot hold the batch: some recompute
    got = [list(o.outputs[0].token_ids) for o in outs]
    for image, tokens, out in zip((a, b, None, c), got, outs):
        ids = list(out.prompt_token_ids)
        if image is None:
            with torch.no_grad():
                t = torch.tensor([ids])
                want = model.generate(input_ids=t, attention_mask=torch.ones_like(t), do_sample=False,
                                      max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                                      pad_token_id=0)[0, len(ids):].tolist()
        else:
            assert ids.count(IMAGE_ID) in (40, 6)  # the placeholder expanded to the image's token count
            want = hf_generate(model, processor, image, ids)
        assert tokens == want
    assert got[0] != got[1]  # one patch of difference shows in the tokens: the image reaches the model
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_pages  # nothing held once all finished


def test_prefix_cache_never_shares_an_image_it_does_not_hold(served):
    model, processor, llm = served
    a, b, _ = images()
    llm.engine.reset_prefix_cache()
    hits = lambda: llm.engine.stats().prefix_cache_hit_tokens  # noqa: E731
    first = llm.generate([prompt(a)], greedy())[0]
    h0 = hits()
    other = llm.generate([prompt(b)], greedy())[0]
    # Only the text-only first page is shared: the pages holding image b's tokens are not image a's.
    assert hits() - h0 == PAGE
    assert list(other.outputs[0].token_ids) == hf_generate(model, processor, b, list(other.prompt_token_ids))
    cache = llm.engine.part(Multimodal).cache
    h1, enc_hits = hits(), cache.hits
    again = llm.generate([prompt(a)], greedy())[0]
    n = len(again.prompt_token_ids)
    assert hits() - h1 == (n - 1) // PAGE * PAGE  # every full page of the same image prompt is reused
    assert cache.hits == enc_hits + 1  # and its encoder output
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_images_are_refused(served):
    _, _, llm = served
    a, _, _ = images()
    engine = llm.engine
    queued = len(engine.requests)
    cases = {
        "not an image": {"prompt_token_ids": TEXT + [IMAGE_ID], "multi_modal_data": {"image": "a string"}},
        "placeholders": {"prompt_token_ids": TEXT, "multi_modal_data": {"image": a}},
        "limit_mm_per_prompt": {"prompt_token_ids": (TEXT + [IMAGE_ID]) * 5, "multi_modal_data": {"image": [a] * 5}},
        "empty": {"prompt_token_ids": TEXT + [IMAGE_ID], "multi_modal_data": {"image": np.zeros((0, 4, 3), np.uint8)}},
        "expected {'image'": {"prompt_token_ids": TEXT, "multi_modal_data": {"video": a}},
    }
    for words, p in cases.items():
        with pytest.raises(InvalidParameterError, match=words) as e:
            engine.make_request("bad", p, greedy())
        assert e.value.param == "multi_modal_data"
    assert len(engine.requests) == queued
    assert list(llm.generate([prompt(a)], greedy())[0].outputs[0].token_ids)  # still serving


def test_text_model_refuses_images():
    import jax

    from conftest import tiny_config
    from model.params import init_params

    cfg = tiny_config()
    llm = LLM(config=cfg, params=init_params(cfg, jax.random.PRNGKey(0)), num_pages=8, page_size=8,
              max_num_batched_tokens=16, max_num_seqs=2)
    with pytest.raises(InvalidParameterError, match="does not take images"):
        llm.engine.make_request("x", {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": images()[0]}})


def test_chat_takes_images(served):
    """`LLM.chat` puts an image part's image prompt where the part is and serves it like `generate`."""
    model, processor, llm = served
    a, _, c = images()
    conv = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "image": a},
                                         {"type": "text", "text": "and"}, {"type": "image", "image": c}]}]
    out = llm.chat(conv, greedy())[0]
    ids = list(out.prompt_token_ids)
    assert ids.count(IMAGE_ID) == 46 and ids.count(START_ID) == 2
    pixels_a, grid_a = hf_pixels(processor, [a])
    pixels_c, grid_c = hf_pixels(processor, [c])
    t = torch.tensor([ids])
    with torch.no_grad():
        want = model.generate(input_ids=t, attention_mask=torch.ones_like(t),
                              pixel_values=torch.tensor(np.concatenate([pixels_a, pixels_c])),
                              image_grid_thw=torch.tensor(np.concatenate([grid_a, grid_c])),
                              mm_token_type_ids=(t == IMAGE_ID).int(), do_sample=False, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert list(out.outputs[0].token_ids) == want


def test_encoder_cache_evicts_least_recent_past_its_bytes():
    from serving.features.multimodal import Encoded, EncoderCache

    entry = lambda: Encoded(np.zeros((4, 8), np.float32), (1, 4, 4))  # noqa: E731  (128 bytes)
    cache = EncoderCache(capacity_bytes=300)
    cache.put(b"a", entry())
    cache.put(b"b", entry())
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", entry())  # 384 bytes > 300: b, the least recent, goes
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"c") is not None
    assert len(cache) == 2 and cache.hits == 3 and cache.misses == 1
    cache.put(b"huge", Encoded(np.zeros((100, 8), np.float32), (1, 20, 20)))  # larger than the cache: not kept
    assert cache.get(b"huge") is None and len(cache) == 2


def test_placeholders_expand_once():
    from serving.features.multimodal import expand_placeholders

    assert expand_placeholders([5, IMAGE_ID, 6, IMAGE_ID], IMAGE_ID, [3, 2]) == (
        [5, IMAGE_ID, IMAGE_ID, IMAGE_ID, 6, IMAGE_ID, IMAGE_ID], [1, 5])
    # A prompt already expanded (as the HF processor leaves it) is taken as it is.
    assert expand_placeholders([5] + [IMAGE_ID] * 3, IMAGE_ID, [3]) == ([5] + [IMAGE_ID] * 3, [1])
    with pytest.raises(InvalidParameterError, match="expected 1 or 3"):
        expand_placeholders([5, IMAGE_ID, IMAGE_ID], IMAGE_ID, [3])
