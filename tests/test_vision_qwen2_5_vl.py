"""Qwen2.5-VL in the model layer against transformers: a tiny random
`Qwen2_5_VLForConditionalGeneration` written by transformers, converted by `model.convert_hf`, run on
images made here.

* preprocessing (`model.vision.qwen2_5_vl_processor`): pixel values, grids and placeholder counts equal
  to the checkpoint's processor (`Qwen2VLImageProcessorPil`) for an RGB array and an RGBA PIL image;
* the encoder (`model.vision.qwen2_5_vl.encode`): image features within 1e-4 of `get_image_features`,
  with windows that do not tile the image (partial windows) and one full-attention block;
* the decoder with M-RoPE: prompt log-probabilities within 1e-4, prefilled in one call and in chunks
  whose boundaries cut through the image's placeholder tokens;
* 16 greedy tokens identical to transformers' `generate` (decode positions continuing past the image).

Engine (`LLM`, 16-token steps), on the outputs of transformers' own `Qwen2_5_VLProcessor` (a Qwen-style
tokenizer and chat template written here): greedy tokens equal `generate`'s for two images of different
sizes before the text, two images of one size, and images between pieces of text; and a model that
generates the image placeholder id first embeds it as a token, as transformers does, not as an image row.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from model.cache import init_cache, pack_batch  # noqa: E402
from model.forward import forward_jit  # noqa: E402
from model.vision.mrope import positions_for, prompt_positions  # noqa: E402
from model.vision.qwen2_5_vl import encode_jit, image_layout, layout_arrays  # noqa: E402
from model.vision.qwen2_5_vl_processor import num_image_tokens, preprocess  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from test_hf_parity import save_and_convert, scale_weights_  # noqa: E402

TOL = 1e-4
IMAGE_ID, VIDEO_ID, START_ID, END_ID = 290, 291, 288, 289
PAGE_SIZE, NUM_PAGES, NUM_TOKENS, MAX_SEQS, PAGES_PER_SEQ = 8, 32, 64, 2, 16


def make_images():
    rng = np.random.default_rng(7)
    rgb = rng.integers(0, 256, (150, 210, 3), dtype=np.uint8)  # resized to 140 x 224: a 10 x 16 patch grid
    rgba = Image.fromarray(rng.integers(0, 256, (60, 90, 4), dtype=np.uint8), "RGBA")  # 56 x 84
    return [rgb, rgba]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_converted(tmp_path_factory)


@pytest.fixture(scope="module")
def converted(built):
    return built[:4]


@pytest.fixture(scope="module")
def hf_dir(built):
    return built[5]


def build_converted(tmp_path_factory, name: str = "qwen2_5_vl"):
    """(HF model, HF image processor, our config, our params, converted directory, HF directory) of the
    tiny model."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                          "rope_theta": 10000.0}),
        # window_size 56: 2 x 2 merged tokens per window, so a 5 x 8 token image has partial windows.
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
        vision_end_token_id=END_ID, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    scale_weights_(model, bias_std=0.5)
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    hf_dir, out_dir, ours_cfg, params = save_and_convert(
        model, tmp_path_factory, name, after_save=lambda d: processor.save_pretrained(d))
    return model, processor, ours_cfg, params, out_dir, hf_dir


def hf_pixels(processor, images):
    out = processor(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def test_config_reads_vision_and_processor(converted):
    _, _, cfg, _ = converted
    assert cfg.mrope_section == (2, 3, 3) and cfg.image_token_id == IMAGE_ID
    assert cfg.vision.depth == 3 and cfg.vision.fullatt_block_indexes == (1,) and cfg.vision.window_size == 56
    assert cfg.vision.max_pixels == 28 * 28 * 64  # from preprocessor_config.json, not the default


def test_pixel_values_equal_processor(converted):
    _, processor, cfg, _ = converted
    for image in make_images():
        expected, grid = hf_pixels(processor, [image])
        got = preprocess(image, cfg.vision)
        assert got.grid == tuple(grid[0])
        np.testing.assert_array_equal(got.patches, expected)
        h, w = (image.shape[:2] if isinstance(image, np.ndarray) else (image.height, image.width))
        assert got.num_tokens == num_image_tokens(h, w, cfg.vision) == int(np.prod(grid[0])) // 4
    big = np.zeros((600, 900, 3), np.uint8)  # above max_pixels: scaled down, as the processor does
    assert preprocess(big, cfg.vision).grid == tuple(hf_pixels(processor, [big])[1][0])


def our_features(cfg, params, image):
    p = preprocess(image, cfg.vision)
    return np.asarray(encode_jit(params.vision, jnp.asarray(p.patches), layout_arrays(image_layout(p.grid, cfg.vision)),
                                 cfg.vision)), p


def test_image_features_match(converted):
    model, processor, cfg, params = converted
    for image in make_images():
        pixels, grid = hf_pixels(processor, [image])
        with torch.no_grad():
            expected = model.model.get_image_features(torch.tensor(pixels), torch.tensor(grid)).pooler_output[0].numpy()
        got, _ = our_features(cfg, params, image)
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() < TOL * max(1.0, np.abs(expected).max())


def make_prompt(num_tokens: int) -> list[int]:
    return [1, 17, 33, 250, START_ID] + [IMAGE_ID] * num_tokens + [END_ID, 9, 80, 120, 7, 64]


def hf_logprobs(model, processor, image, prompt):
    pixels, grid = hf_pixels(processor, [image])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                       mm_token_type_ids=(ids == IMAGE_ID).int()).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


class VLRunner:
    """One sequence through `model.forward` with M-RoPE positions and image embeddings as step inputs."""

    def __init__(self, cfg, params, prompt, features, grid):
        self.cfg, self.params = cfg, params
        self.cache = init_cache(cfg, NUM_PAGES, PAGE_SIZE)
        self.table = np.random.default_rng(3).permutation(NUM_PAGES)[:PAGES_PER_SEQ].tolist()
        self.rope, self.delta = prompt_positions(prompt, IMAGE_ID, [grid], cfg.vision.spatial_merge_size)
        self.features = features  # [image tokens, hidden]
        self.image_start = prompt.index(IMAGE_ID)

    def step(self, ids, start):
        tokens, md = pack_batch([(ids, start, self.table)], page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                                num_tokens=NUM_TOKENS, max_seqs=MAX_SEQS, pages_per_seq=PAGES_PER_SEQ,
                                logits_rows=NUM_TOKENS, all_logits=True)
        rope = np.zeros((3, NUM_TOKENS), np.int32)
        rope[:, :len(ids)] = positions_for(self.rope, self.delta, start, len(ids))
        embeds = np.zeros((NUM_TOKENS, self.cfg.hidden_size), np.float32)
        for row in range(len(ids)):  # this chunk's slice of the image's embeddings
            k = start + row - self.image_start
            if 0 <= k < len(self.features) and ids[row] == IMAGE_ID:
                embeds[row] = self.features[k]
        md = dataclasses.replace(md, rope_positions=rope)
        logits, self.cache = forward_jit(self.params, self.cache, tokens, md, self.cfg, backend="reference",
                                         image_embeds=embeds)
        return np.asarray(logits)[:len(ids)]


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize("chunks", [(None,), (7, 13, 11, None)], ids=["one_call", "chunks_cut_the_image"])
def test_prompt_logprobs_match(converted, chunks):
    model, processor, cfg, params = converted
    image = make_images()[0]
    features, processed = our_features(cfg, params, image)
    prompt = make_prompt(processed.num_tokens)
    expected = hf_logprobs(model, processor, image, prompt)
    runner = VLRunner(cfg, params, prompt, features, processed.grid)
    got, start = [], 0
    for size in chunks:
        size = len(prompt) - start if size is None else size
        got.append(runner.step(prompt[start:start + size], start))
        start += size
    got = _log_softmax(np.concatenate(got))
    assert np.abs(got - expected).max() < TOL


def test_greedy_tokens_match_generate(converted):
    model, processor, cfg, params = converted
    image = make_images()[1]
    features, processed = our_features(cfg, params, image)
    prompt = make_prompt(processed.num_tokens)
    pixels, grid = hf_pixels(processor, [image])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.tensor(pixels),
                             image_grid_thw=torch.tensor(grid), mm_token_type_ids=(ids == IMAGE_ID).int(),
                             do_sample=False, max_new_tokens=16, min_new_tokens=16, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    runner = VLRunner(cfg, params, prompt, features, processed.grid)
    assert runner.delta != 0  # the image moves the positions off the token count
    logits = runner.step(prompt, 0)
    got = [int(np.argmax(logits[-1]))]
    while len(got) < 16:
        got.append(int(np.argmax(runner.step([got[-1]], len(prompt) + len(got) - 1)[-1])))
    assert got == expected


def test_mrope_positions_continue_after_image():
    # 2 text tokens, a 1 x 4 x 6 patch grid (2 x 3 tokens), 2 text tokens.
    tokens = [5, 6] + [IMAGE_ID] * 6 + [7, 8]
    pos, delta = prompt_positions(tokens, IMAGE_ID, [(1, 4, 6)], 2)
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3] and pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert pos[:, 8:].tolist() == [[5, 6]] * 3  # start + max(2, 3)
    assert delta == 7 - 10
    assert positions_for(pos, delta, 9, 3).tolist() == [[6, 7, 8]] * 3  # the last prompt token, then decode
    with pytest.raises(ValueError):
        prompt_positions(tokens, IMAGE_ID, [], 2)


def test_mrope_and_image_embeddings_are_exercised(converted):
    """Flat positions, or the placeholder's own embedding, break parity: the test above is of both."""
    model, processor, cfg, params = converted
    image = make_images()[0]
    features, processed = our_features(cfg, params, image)
    prompt = make_prompt(processed.num_tokens)
    expected = hf_logprobs(model, processor, image, prompt)
    flat = VLRunner(cfg, params, prompt, features, processed.grid)
    flat.rope, flat.delta = np.broadcast_to(np.arange(len(prompt)), (3, len(prompt))), 0
    assert np.abs(_log_softmax(flat.step(prompt, 0)) - expected).max() > 100 * TOL
    blank = VLRunner(cfg, params, prompt, np.zeros_like(features), processed.grid)
    assert np.abs(_log_softmax(blank.step(prompt, 0)) - expected).max() > 100 * TOL


def test_converts_the_nested_names_of_transformers_4_52(converted, hf_dir, tmp_path):
    """transformers 4.52-4.57 saved the decoder under `model.language_model.` and the vision tower under
    `model.visual.`: such a checkpoint converts to the same weights."""
    import os
    import shutil

    from safetensors.numpy import load_file, save_file

    from model.checkpoint import load_checkpoint
    from model.convert_hf import convert
    from model.params import flatten_params

    nested = tmp_path / "nested"
    nested.mkdir()
    for name in os.listdir(hf_dir):
        if name != "model.safetensors":
            shutil.copy(os.path.join(hf_dir, name), nested / name)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    renamed = {("model.visual." + k[len("visual."):]) if k.startswith("visual.") else
               ("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    save_file(renamed, str(nested / "model.safetensors"))
    convert(str(nested), str(tmp_path / "out"), dtype="float32", progress=False)
    _, params = load_checkpoint(str(tmp_path / "out"))
    want = flatten_params(converted[3])
    got = flatten_params(params)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


# --- the engine, on the HF processor's outputs ---------------------------------------------------------

NEW_TOKENS = 8
ENGINE = dict(page_size=PAGE_SIZE, max_model_len=128, num_pages=40, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, min_context_bucket=128, encoder_cache_mb=1)

# A Qwen2.5-VL-style chat template: an image part is vision start, the image pad, vision end.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def save_tokenizer(directory):
    """A Qwen-style tokenizer that fits the model's 300 ids: the chat specials, the 256 byte tokens, a few
    letters and merges, then vision start, vision end, the image pad and the video pad at 288-291."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    for ch in "\n\u2581Cadehimnoprst.":
        vocab[ch] = len(vocab)
    merges = [("t", "h"), ("th", "e"), ("the", "m"), ("a", "n"), ("an", "d")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(vocab), START_ID)})
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    vocab.update({t: START_ID + i for i, t in enumerate(vision)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials + vision])
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(os.path.join(directory, "tokenizer.json"))
    conf = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f)


class _Processor(transformers.Qwen2_5_VLProcessor):
    """transformers' Qwen2.5-VL processor for images alone: its video processor needs torchvision, and
    no prompt here holds a video."""

    def check_argument_for_proper_class(self, name, arg):
        if arg is not None:
            return super().check_argument_for_proper_class(name, arg)


@pytest.fixture(scope="module")
def hf_processor(built, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen2_5_vl_tokenizer"))
    save_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return _Processor(image_processor=built[1], tokenizer=tokenizer, video_processor=None, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(built):
    return LLM(built[4], **ENGINE)


def chat_images():
    """(A: 150 x 210, resized to a 10 x 16 patch grid; B: 56 x 84 as the processor takes it, 2 x 3 tokens;
    C: B's size, other pixels)."""
    rng = np.random.default_rng(5)
    a, b, c = (Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
               for shape in ((150, 210, 3), (84, 56, 3), (84, 56, 3)))
    return a, b, c


def chat_cases():
    a, b, c = chat_images()
    image, text = (lambda im: {"type": "image", "image": im}), (lambda t: {"type": "text", "text": t})
    return {"different_sizes": [image(a), image(b), text("Compare them.")],
            "same_size": [image(b), image(c), text("Compare them.")],
            "between_text": [text("Compare"), image(b), text("and"), image(a), text("then.")]}


def processor_inputs(processor, content):
    """The processor's prompt ids (placeholders expanded), the images in prompt order, and its tensors."""
    inputs = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")
    images = [part["image"] for part in content if part["type"] == "image"]
    return inputs["input_ids"][0].tolist(), images, inputs


def generate_like_hf(model, inputs):
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_images_in_one_chat_match_generate(built, hf_processor, engine):
    """Each case's prompt ids, pixels and grids are the processor's; the engine takes the ids (already
    expanded) and the images, preprocesses and encodes them itself, and answers with `generate`'s tokens."""
    model = built[0]
    cases = {name: processor_inputs(hf_processor, content) for name, content in chat_cases().items()}
    grids = {name: inputs["image_grid_thw"].tolist() for name, (_, _, inputs) in cases.items()}
    assert grids["different_sizes"] == [[1, 10, 16], [1, 6, 4]] and grids["same_size"] == [[1, 6, 4]] * 2
    outs = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                            for ids, images, _ in cases.values()], greedy())
    for (name, (ids, _, inputs)), out in zip(cases.items(), outs):
        assert list(out.prompt_token_ids) == ids, name
        assert list(out.outputs[0].token_ids) == generate_like_hf(model, inputs), name


def test_generated_placeholder_is_embedded_as_a_token(built, hf_processor):
    """A model that generates the image placeholder id (here made the first greedy token: its output row
    set to twice the usual first token's) feeds it back as a token, as transformers does: its embedding
    row, not an image's (nor an empty one). The second token on shows it."""
    model, _, cfg, params, _, _ = built
    ids, images, inputs = processor_inputs(hf_processor, chat_cases()["different_sizes"])
    first = generate_like_hf(model, inputs)[0]
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.lm_head.weight[IMAGE_ID] = 2 * edited.lm_head.weight[first]
    want = generate_like_hf(edited, inputs)
    assert want[0] == IMAGE_ID
    lm_head = np.asarray(params.lm_head).copy()
    lm_head[IMAGE_ID] = 2 * lm_head[first]
    llm = LLM(config=cfg, params=dataclasses.replace(params, lm_head=jnp.asarray(lm_head)), **ENGINE)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], greedy())[0]
    assert list(out.outputs[0].token_ids) == want
