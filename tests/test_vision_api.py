"""Image parts of `/v1/chat/completions` through the official `openai` client (`serving.api.media`).

A tiny random Qwen2.5-VL is served in-process. A `data:` URL PNG gets the tokens transformers'
`generate` gives for the same conversation, and so do two images of different sizes before the text;
JPEG and WebP data URLs are decoded; an http URL on an allowed host (a local HTTP server, same-host
redirect included) is fetched and gives what the same image as a data URL gives. Refused: hosts not
allowed, a redirect to another host, other schemes, oversized and undecodable images, bad base64, too
many images, images to a text model; each a 400 naming the part, and the server keeps serving with no
KV page held.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
from PIL import Image  # noqa: E402

from serving import LLM  # noqa: E402
from serving.features.multimodal import Multimodal  # noqa: E402
from serving.api import http_protocol as P  # noqa: E402
from serving.api.chat_template import IMAGE_SENTINEL, encode_chat  # noqa: E402
from serving.api.media import MediaOptions  # noqa: E402
from serving.features.multimodal import expand_placeholders  # noqa: E402
from serving.server import ServerThread  # noqa: E402
from test_vision_engine import ENGINE, NEW_TOKENS, hf_generate, images  # noqa: E402
from test_vision_qwen2_5_vl import IMAGE_ID, build_converted, hf_pixels  # noqa: E402

MAX_BYTES = 150_000


def encoded(image: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


class _Files(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v.replace("PORT", str(self.server.server_port)))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, processor, cfg, _, out_dir, _ = build_converted(tmp_path_factory, "qwen2_5_vl_api")
    a = images()[0]
    png = encoded(a, "PNG")
    _Files.routes = {
        "/a.png": (200, {"Content-Type": "image/png"}, png),
        "/same-host": (302, {"Location": "/a.png"}, b""),
        "/other-host": (302, {"Location": "http://localhost:PORT/a.png"}, b""),
        "/big.png": (200, {"Content-Type": "image/png"}, b"\0" * (MAX_BYTES + 1)),
    }
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    llm = LLM(out_dir, **ENGINE)
    media = MediaOptions(allowed_domains=("127.0.0.1",), max_bytes=MAX_BYTES, fetch_timeout_s=5.0)
    with ServerThread(llm, model_name="vl", media=media, kv_transfer_secret="secret") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        yield types.SimpleNamespace(model=model, processor=processor, llm=llm, client=client, a=a, png=png, url=srv.url,
                                    files=f"http://127.0.0.1:{files.server_port}",
                                    other=f"http://localhost:{files.server_port}")
    files.shutdown()


def ask(s, *urls, text="what is this?"):
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return s.client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                            temperature=0, max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})


def test_data_url_matches_transformers(served):
    s = served
    reply = ask(s, data_url(s.png))
    tok, vision = s.llm.tokenizer, s.llm.config.vision
    ids = encode_chat([{"role": "user", "content": "what is this?" + IMAGE_SENTINEL}], tok, True, None,
                      image_ids=vision.image_prompt_ids)
    ids, _ = expand_placeholders(ids, IMAGE_ID, [40])
    assert reply.usage.prompt_tokens == len(ids)
    want = hf_generate(s.model, s.processor, s.a, ids)
    assert reply.choices[0].message.content == tok.decode(want)
    assert reply.usage.completion_tokens == NEW_TOKENS


def test_two_images_before_the_text_match_transformers(served):
    """[image A (150 x 210, 40 tokens), image B (56 x 84, 6 tokens), "Compare them."]: the PNGs decoded,
    resized and encoded by the server answer with `generate`'s tokens on the processor's pixels and grids
    of both images, for the ids the chat template gives with each image's placeholders expanded."""
    s = served
    b = np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    content = [{"type": "image_url", "image_url": {"url": data_url(encoded(im, "PNG"))}} for im in (s.a, b)]
    reply = s.client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content + [{"type": "text", "text": "Compare them."}]}],
        temperature=0, max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    tok, vision = s.llm.tokenizer, s.llm.config.vision
    ids = encode_chat([{"role": "user", "content": IMAGE_SENTINEL * 2 + "Compare them."}], tok, True, None,
                      image_ids=vision.image_prompt_ids)
    ids, _ = expand_placeholders(ids, IMAGE_ID, [40, 6])
    assert reply.usage.prompt_tokens == len(ids)
    pixels, grid = hf_pixels(s.processor, [s.a, b])
    assert grid.tolist() == [[1, 10, 16], [1, 4, 6]]
    t = torch.tensor([ids])
    with torch.no_grad():
        want = s.model.generate(input_ids=t, attention_mask=torch.ones_like(t), pixel_values=torch.tensor(pixels),
                                image_grid_thw=torch.tensor(grid), mm_token_type_ids=(t == IMAGE_ID).int(),
                                do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert reply.choices[0].message.content == tok.decode(want)


def test_jpeg_webp_and_fetched_urls(served):
    s = served
    for fmt, media_type in (("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        assert ask(s, data_url(encoded(s.a, fmt), media_type)).usage.completion_tokens == NEW_TOKENS
    cache = s.llm.engine.part(Multimodal).cache
    hits = cache.hits
    inline = ask(s, data_url(s.png)).choices[0].message.content
    fetched = ask(s, s.files + "/a.png").choices[0].message.content
    redirected = ask(s, s.files + "/same-host").choices[0].message.content
    assert fetched == redirected == inline
    assert cache.hits >= hits + 3  # the same pixels, encoded once


@pytest.mark.parametrize("case", ["host", "redirect", "scheme", "big_fetch", "big_data", "undecodable", "base64",
                                  "too_many"])
def test_bad_images_are_400s_naming_the_part(served, case):
    s = served
    bad = {
        "host": (s.other + "/a.png", "not allowed"),
        "redirect": (s.files + "/other-host", "another host"),
        "scheme": ("file:///etc/passwd", "scheme"),
        "big_fetch": (s.files + "/big.png", "limit"),
        "big_data": (data_url(b"\0" * (MAX_BYTES + 1)), "limit"),
        "undecodable": (data_url(b"this is not an image"), "not a decodable image"),
        "base64": ("data:image/png;base64,@@@not-base64", "base64"),
    }
    if case == "too_many":
        urls, words, part = [data_url(s.png)] * 5, "limit_mm_per_prompt", "messages[0].content[5]"
    else:
        (url, words), part = bad[case], "messages[0].content[1]"
        urls = [url]
    with pytest.raises(openai.BadRequestError) as e:
        ask(s, *urls)
    assert e.value.status_code == 400
    assert words in str(e.value) and part in str(e.value)
    assert e.value.body["param"] == part


def test_server_keeps_serving_with_no_pages_held(served):
    s = served
    with pytest.raises(openai.BadRequestError):
        ask(s, data_url(b"junk"))
    assert ask(s, data_url(s.png)).usage.completion_tokens == NEW_TOKENS
    engine = s.llm.engine
    deadline = time.monotonic() + 10
    while engine.block_manager.num_free_blocks != engine.num_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.block_manager.num_free_blocks == engine.num_pages


def test_text_model_refuses_image_parts():
    from serving.api.http_app import ServingContext

    core = types.SimpleNamespace(cfg=types.SimpleNamespace(vision=None), config=types.SimpleNamespace())
    ctx = ServingContext(types.SimpleNamespace(engine=core), None, "m", 64)
    req = P.ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}])
    with pytest.raises(P.APIError, match=r"messages\[0\].content\[1\]: this model does not take images"):
        asyncio.run(ctx.chat_images(req))
    # /tokenize renders the prompt without loading images: the same 400, not an internal error.
    with pytest.raises(P.APIError, match=r"messages\[0\].content\[1\]: this model does not take images"):
        ctx.chat_prompt(req)


def test_disaggregated_image_chat(served):
    """An image chat prefilled by /internal/prefill and resumed by /internal/decode (the same worker in
    both roles here) answers as the chat route does; the payload carries the image's rows."""
    import httpx

    from model.families import kv_bytes_per_token
    from serving.disaggregation.disagg import run_disaggregated

    s = served
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(s.png)}}]
    body = {"model": "vl", "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}
    whole = s.client.chat.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                             extra_body={"ignore_eos": True})

    async def disaggregated():
        async with httpx.AsyncClient(timeout=60) as client:
            resp, rec = await run_disaggregated(client, s.url, s.url, "/v1/chat/completions", body)
            try:
                return (await resp.aread(), resp.status_code), rec
            finally:
                await resp.aclose()

    (raw, status), rec = asyncio.run(disaggregated())
    assert status == 200, raw
    reply = P.ChatCompletionResponse.model_validate_json(raw)
    assert reply.choices[0].message.content == whole.choices[0].message.content
    assert reply.usage.prompt_tokens == whole.usage.prompt_tokens == rec.num_tokens
    per_token = kv_bytes_per_token(s.llm.config, s.llm.engine.runner.kv_dtype)
    assert rec.kv_bytes == per_token * rec.num_tokens + 40 * s.llm.config.hidden_size * 4  # K/V, then 40 image rows


def test_streamed_chat_with_an_image(served):
    """The streamed reply is the non-streamed one, and its usage counts the expanded image tokens."""
    s = served
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": data_url(s.png)}}]
    kwargs = dict(model="vl", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=NEW_TOKENS,
                  extra_body={"ignore_eos": True})
    whole = s.client.chat.completions.create(**kwargs)
    chunks = list(s.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 40
