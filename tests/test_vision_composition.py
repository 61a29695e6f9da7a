"""Image requests composed with the engine's other features: tensor parallelism (TP=2: the decoder
sharded, the encoder replicated), pipeline stages (PP=2: image rows merged before the first stage,
multimodal positions on every stage), int8 weights (the decoder's linear layers quantized, the encoder
kept in float), warm-up (image steps run in the compiled buckets: nothing recompiles), and
disaggregated prefill (the prefill engine encodes the images and ships their outputs with the K/V; the
decode engine never runs the encoder, and its prefix cache tells the images apart), n-gram and
text-only draft-model speculation (greedy tokens unchanged), an int8 KV cache swapped to the host tier
on preemption; and the encoder
itself runs padded to a few patch counts, exactly, every one compiled at warm-up.

The reference is the float TP=1 engine, itself matched against transformers in `test_vision_engine`.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from serving import LLM, SamplingParams  # noqa: E402
from serving.spec_decode import SpecDecoder
from serving.features.multimodal import Multimodal  # noqa: E402
from conftest import run_to_completion  # noqa: E402
from model.vision import encoder  # noqa: E402
from model.vision import encoder_buckets  # noqa: E402
from serving.core import model_runner  # noqa: E402
from serving.features import multimodal  # noqa: E402
from serving.core.sampling_params import InvalidParameterError  # noqa: E402
from serving.disaggregation import kv_transfer as kt  # noqa: E402
from serving.disaggregation import kv_wire  # noqa: E402
from test_vision_engine import ENGINE, NEW_TOKENS, TEXT, images, prompt  # noqa: E402
from test_vision_qwen2_5_vl import build_converted  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The checkpoint, its prompts (two images and a text-only one) and the TP=1 float engine's greedy tokens."""
    out_dir = build_converted(tmp_path_factory, "qwen2_5_vl_composition")[4]
    a, b, c = images()
    prompts = [prompt(a), prompt(c), TEXT + [9, 80, 120]]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = LLM(out_dir, **ENGINE).generate(prompts, sp)
    return out_dir, prompts, sp, outs


def _prompt_logprobs(out):
    ids = out.prompt_token_ids
    return np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])])


def test_tp2_identical_to_tp1(reference):
    out_dir, prompts, sp, want = reference
    llm = LLM(out_dir, tensor_parallel_size=2, **ENGINE)
    assert len(llm.engine.runner.params.layers[0].wq.sharding.device_set) == 2
    got = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(_prompt_logprobs(g), _prompt_logprobs(w), atol=1e-4)


def test_pipeline_stages_identical_to_one_device(reference):
    """PP=2 with 3 microbatches (an image's rows cut across microbatches): the image rows merge before
    the first stage, the multimodal positions reach both stages."""
    out_dir, prompts, sp, want = reference
    llm = LLM(out_dir, pipeline_parallel_size=2, num_microbatches=3, **ENGINE)
    assert llm.engine.runner.layout.pipeline_parallel_size == 2
    got = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(_prompt_logprobs(g), _prompt_logprobs(w), atol=1e-4)


def test_int8_weights(reference):
    out_dir, prompts, sp, want = reference
    llm = LLM(out_dir, weight_dtype="int8", **ENGINE)
    assert llm.config.weight_dtype == "int8"
    assert llm.engine.runner.params.vision.blocks[0].qkv.dtype == np.float32  # the encoder stays float
    got = llm.generate(prompts, sp)
    diffs = np.concatenate([np.abs(_prompt_logprobs(g) - _prompt_logprobs(w)) for g, w in zip(got, want)])
    # Per-channel int8 moves a prompt logprob by hundredths, not by the units a misplaced image would.
    assert 0 < diffs.mean() < 0.2
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in got)


def test_nothing_recompiles_after_warm_up(reference):
    out_dir, prompts, sp, want = reference
    llm = LLM(out_dir, warmup=True, **ENGINE)
    before = model_runner.compilation_count()
    got = llm.generate(prompts, sp)
    assert model_runner.compilation_count() == before
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def _greedy(out):
    return [o.outputs[0].token_ids for o in out]


def test_ngram_speculation_keeps_the_greedy_tokens(reference):
    """Prompt lookup over prompts holding image placeholders: verification with multimodal positions
    past the image keeps every greedy token."""
    out_dir, prompts, _, want = reference
    llm = LLM(out_dir, speculative_method="ngram", num_speculative_tokens=3, **ENGINE)
    assert _greedy(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                        ignore_eos=True))) == _greedy(want)
    assert llm.engine.part(SpecDecoder).stats.num_draft_tokens > 0


def test_text_draft_model_drafts_for_the_vision_target(reference):
    """A text-only draft (here the target's own decoder without its encoder) reads an image's placeholder
    ids as text at plain positions; it only proposes, so the target's greedy tokens stay, and its drafts
    are accepted often. A draft that takes images is refused: drafting gives it no image rows."""
    import dataclasses

    from model.checkpoint import load_checkpoint

    out_dir, prompts, _, want = reference
    cfg, params = load_checkpoint(out_dir)
    text_draft = (cfg.replace(vision=None, image_token_id=None, mrope_section=None),
                  dataclasses.replace(params, vision=None))
    llm = LLM(out_dir, speculative_method="draft", num_speculative_tokens=3, speculative_draft=text_draft, **ENGINE)
    assert _greedy(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                        ignore_eos=True))) == _greedy(want)
    assert llm.engine.part(SpecDecoder).stats.num_accepted_tokens > 0
    with pytest.raises(ValueError, match="draft model takes images"):
        LLM(out_dir, speculative_method="draft", num_speculative_tokens=3, speculative_draft=(cfg, params), **ENGINE)


def test_int8_kv_pages_swapped_to_the_host_tier(reference):
    """An int8 KV cache with the host tier and swap preemption: the pool cannot hold the batch, so image
    requests' pages (int8 values and their scales) go to the host and come back; each request gets the
    greedy tokens it gets alone, and its prompt log-probabilities stay within hundredths of the float
    cache's."""
    out_dir, prompts, sp, want = reference
    llm = LLM(out_dir, kv_cache_dtype="int8", kv_offload_bytes=2**20, preemption_mode="swap", **ENGINE)
    sp = sp.clone()
    sp.max_tokens = 40  # 28 pages for the three requests, of the pool's 18
    alone = [llm.generate([p], sp)[0] for p in prompts]
    together = llm.generate(prompts, sp)
    st = llm.engine.stats().host_kv
    assert st.preemptions_swap > 0 and st.preemptions_recompute == 0 and st.pages_restored > 0
    assert _greedy(together) == _greedy(alone)
    diffs = np.concatenate([np.abs(_prompt_logprobs(g) - _prompt_logprobs(w)) for g, w in zip(together, want)])
    assert diffs.mean() < 0.1  # a misplaced image moves them by units


KEYS = kv_wire.SigningKeys("shared by both workers")


def _ship(engine, rid, prompt_, sp) -> bytes:
    """The prefill of `prompt_` on `engine` (its first token), as a signed payload."""
    exports = []
    first = sp.clone()
    first.max_tokens = 1
    req = engine.make_request(rid, prompt_, first, part_args={"kv_export": kt.Exporter(exports.append)})
    engine.enqueue(req)
    run_to_completion(engine)
    return kt.encode_payload(exports[0], engine.cfg, engine.runner.kv_dtype, KEYS)


def _resume(engine, rid, prompt_, sp, payload: bytes) -> None:
    """Queues `prompt_` on `engine` resuming from `payload`, its images taken from the payload."""
    header, body = kt.decode_payload(payload, KEYS, engine.cfg, engine.runner.kv_dtype, engine.max_model_len)
    imp = kt.to_import(header, body, engine.cfg, engine.runner.kv_dtype)
    shipped = dict(prompt_, multi_modal_data={"image": imp.encoded_images})
    req = engine.make_request(rid, shipped, sp, part_args={"kv_import": imp})
    engine.enqueue(req)


def test_disaggregated_prefill_ships_the_images(reference, monkeypatch):
    out_dir, prompts, _, want = reference
    a, b, c = images()
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prefill = LLM(out_dir, **ENGINE)
    want_b = prefill.generate([prompt(b)], sp)[0].outputs[0].token_ids
    payloads = {name: _ship(prefill.engine, name, prompt(im), sp) for name, im in (("a", a), ("b", b), ("c", c))}

    def no_encoder(*args, **kwargs):
        raise AssertionError("the decode side ran the encoder")

    monkeypatch.setattr(multimodal.encoder, "encode", no_encoder)
    monkeypatch.setattr(multimodal.encoder_buckets, "encode", no_encoder)
    monkeypatch.setattr(multimodal.encoder, "preprocess", no_encoder)
    dec = LLM(out_dir, **ENGINE).engine
    for name, im in (("a", a), ("c", c)):
        _resume(dec, name, prompt(im), sp, payloads[name])
    got = run_to_completion(dec)
    assert got["a"].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert got["c"].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert len(dec.part(Multimodal).cache) == 0

    # The decode side's prefix cache names blocks by the shipped digests: the same image hits every full
    # page of the prompt, an image differing in one patch only the text-only first page.
    full_pages = len(got["a"].prompt_token_ids) // ENGINE["page_size"] * ENGINE["page_size"]
    for name, im, payload, hit, tokens in (("a2", a, "a", full_pages, want[0].outputs[0].token_ids),
                                           ("b", b, "b", ENGINE["page_size"], want_b)):
        before = dec.scheduler.prefix_hit_tokens
        _resume(dec, name, prompt(im), sp, payloads[payload])
        assert run_to_completion(dec)[name].outputs[0].token_ids == tokens
        assert dec.scheduler.prefix_hit_tokens - before == hit, name
    assert dec.block_manager.num_used_blocks == 0


def test_shipped_images_must_match_the_request(reference):
    """A payload's images are checked against the request resuming it and the worker's model."""
    out_dir = reference[0]
    a, b, _ = images()
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine = LLM(out_dir, **ENGINE).engine
    payload = _ship(engine, "a", prompt(a), sp)
    header, body = kt.decode_payload(payload, KEYS, engine.cfg, engine.runner.kv_dtype, engine.max_model_len)
    assert [im["num_tokens"] for im in header["images"]] == [40] and header["version"] == kt.VERSION
    imp = kt.to_import(header, body, engine.cfg, engine.runner.kv_dtype)
    req = engine.make_request("b", prompt(b), sp)  # the same text, another image
    with pytest.raises(InvalidParameterError, match="multi_modal_data"):
        kt.check_import(req, imp)
    bad = dict(header, images=[dict(header["images"][0], start=0)])  # placeholders over text tokens
    with pytest.raises(kt.PayloadError, match="image placeholder"):
        kt.to_import(bad, body, engine.cfg, engine.runner.kv_dtype)
    bad = dict(header, images=[dict(header["images"][0], num_tokens=41)])
    with pytest.raises(kt.PayloadError, match="grid"):
        kt.to_import(bad, body, engine.cfg, engine.runner.kv_dtype)


def test_encoder_buckets_are_exact_and_compiled_at_warm_up(reference):
    """Images of sizes never seen before encode, padded to their bucket, to the exact encoder's output,
    and compile nothing once the engine's warm-up compiled the buckets."""
    llm = LLM(reference[0], **ENGINE)
    mm, v = llm.engine.part(Multimodal), llm.config.vision
    sizes = encoder_buckets.bucket_sizes(v)
    assert sizes == (16, 32, 64, 128, 256)  # min_pixels 56 x 56 .. max_pixels 28 x 28 x 64, in 14-pixel patches
    assert mm in llm.engine.parts  # the engine's warm-up runs the part's: here alone, not the step buckets
    info = mm.warm_up()
    assert info["shapes"] == len(sizes)
    rng = np.random.default_rng(5)
    shapes = [(100, 130), (200, 90), (60, 300), (230, 210), (40, 70)]  # 80, 84, 88, 256 and 16 patches
    before = encoder_buckets.compilation_count()
    processed = [encoder.preprocess(rng.integers(0, 256, hw + (3,), dtype=np.uint8), v) for hw in shapes]
    padded = [encoder_buckets.encode(mm.vision_weights, p, v) for p in processed]
    assert encoder_buckets.compilation_count() == before
    assert len({encoder_buckets.bucket_for(p.patches.shape[0], v) for p in processed}) > 1
    for p, got in zip(processed, padded):
        assert got.shape == (p.num_tokens, llm.config.hidden_size)
        np.testing.assert_allclose(got, encoder.encode(mm.vision_weights, p, v), rtol=1e-5, atol=1e-5)
