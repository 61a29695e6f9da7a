"""Image inputs in the engine, a step part: from the images a prompt carries to the step's inputs.

At admission (`Multimodal.expand_prompt`, on the caller's thread) each image is converted to RGB and named by
a digest of its pixels; the encoder's output for that digest comes from `EncoderCache` or is computed
(preprocessing on the host, the encoder on the device, `model.vision.encoder`) and cached, so a repeated
image is encoded once. Each image placeholder token of the prompt is expanded into the image's number of
placeholder tokens (a prompt already expanded, as the HF processor leaves it, is taken as it is), and a
decoder with multimodal RoPE gets the prompt's (temporal, height, width) positions. All of it is the
request's `RequestImages`, its `prompt_content`.

In every step (`Multimodal.pack`) each scheduled sequence writes its rows of the step's
"rope_positions" and "image_embeds" fields (the part's `token_fields`), which the step hands the
forward (`apply_to_inputs`): a prefill chunk takes the slice of
its images' embeddings that falls inside the chunk, wherever the chunk boundaries cut, and a decode
continues the positions past the prompt. Preemption, prefix hits and recompute need nothing more: the
rows follow from (request, first position, count) alone.

Every image token's row also carries the end of its image (the step's "span_end" rows, 0 outside
images): the decoder takes the image's embedding only in those rows, so a placeholder id the model
generates keeps its own embedding (`model.forward.merge_image_embeds`), as in transformers. A model that
attends among one image's tokens both ways (Gemma 3, `VisionConfig.bidirectional`) also reads them as
the image's attention span (`kernels_pallas.reference`), and its prefill chunks never end inside an
image (`RequestImages.chunk_stop`, asked through the scheduler's `ImageChunks` gate): an
image's first tokens attend to its last, so they must be computed in one step. A chunk that would cut
an image ends before it, or, when it starts inside one (after a prefix hit that ended there), takes the
image's rest or waits for a step with room. A prefix hit may end inside an image: the cached pages
were computed with the whole image in view, and the digest chain (below) names that image, so they
are the same K/V the full prompt would compute.

The image digests also enter the prefix cache's digest chain (`Sequence.block_extra`,
`block_manager.block_digest`): a block holding any of an image's placeholder tokens is named by the
image's content too, so two prompts differing only in an image never share a page.

The encoder runs padded to a few patch counts (`encoder_buckets`), all compiled at the engine's warm-up,
so an image of a size not seen before compiles nothing.

An image may also arrive already encoded (`EncodedImage`: a disaggregated prefill ships its images'
digests and encoder outputs with the prompt's K/V, `serving.disaggregation.kv_transfer`): it is placed,
positioned and hashed like any other, and the encoder never runs for it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import time
import weakref
from typing import Optional

import numpy as np

from model.vision import encoder
from model.vision.qwen2_5_vl_processor import to_rgb
from model.vision import encoder_buckets
from serving.core.input_batch import TokenField
from serving.core.sampling_params import InvalidParameterError
from serving.core.scheduler import AdmissionGate
from serving.core.step_parts import StepPart

FIELD = "multi_modal_data"


def image_digest(rgb) -> bytes:
    """16-byte content digest of an RGB PIL image: its size and pixels."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.digest()


@dataclasses.dataclass(frozen=True)
class Encoded:
    """An image's encoder output and what the prompt needs of its preprocessing."""

    embeds: np.ndarray  # [num_tokens, hidden] float32
    grid: tuple  # the processor's (t, h, w) patch grid

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]

    @property
    def nbytes(self) -> int:
        return self.embeds.nbytes


class EncoderCache:
    """Encoder outputs by image digest, least recently used dropped past `capacity_bytes` (thread-safe)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[bytes, Encoded] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, digest: bytes) -> Optional[Encoded]:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(digest)
            self.hits += 1
            return entry

    def put(self, digest: bytes, entry: Encoded) -> None:
        with self._lock:
            if digest in self._entries or entry.nbytes > self.capacity_bytes:
                return
            self._entries[digest] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._entries)


@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """An image encoded elsewhere, taken as it is in place of pixels: its content digest and encoder
    output (what a disaggregated prefill ships, so the decode side never runs the encoder)."""

    digest: bytes
    encoded: Encoded


@dataclasses.dataclass
class PlacedImage:
    digest: bytes
    start: int  # first placeholder position in the prompt
    encoded: Encoded


@dataclasses.dataclass
class RequestImages:
    """A request's images, placed in its prompt, and the prompt's multimodal positions."""

    images: list  # [PlacedImage], in prompt order
    rope_positions: Optional[np.ndarray]  # [3, prompt len] (multimodal RoPE), or None
    delta: int  # positions past the prompt are (index + delta) on every axis
    bidirectional: bool = False  # an image's tokens attend to each other both ways (Gemma 3)

    def digests_between(self, start: int, end: int) -> bytes:
        return b"".join(im.digest for im in self.images
                        if im.start < end and start < im.start + im.encoded.num_tokens)

    def chunk_stop(self, start: int, stop: int) -> int:
        """The end (<= `stop`) of a prefill chunk from `start` that cuts no image attended both ways:
        `start` itself when even the first image it meets does not fit."""
        if not self.bidirectional:
            return stop
        for im in self.images:
            end = im.start + im.encoded.num_tokens
            if im.start < stop < end:
                return im.start if im.start >= start else start
        return stop

    def fill(self, rope_rows, embed_rows, start: int, count: int, span_rows=None) -> None:
        """Writes the rows of positions start..start+count: their multimodal positions, the slice of
        each image's embeddings that falls among them and each image row's span end (`span_rows`, zero
        elsewhere: what tells an image's placeholder from a generated one, and, for images attended both
        ways, their attention span)."""
        if self.rope_positions is not None:
            idx = np.arange(start, start + count)
            inside = idx < self.rope_positions.shape[1]
            rope_rows[:] = idx + self.delta
            rope_rows[:, inside] = self.rope_positions[:, idx[inside]]
        for im in self.images:
            lo, hi = max(start, im.start), min(start + count, im.start + im.encoded.num_tokens)
            if lo < hi:
                embed_rows[lo - start:hi - start] = im.encoded.embeds[lo - im.start:hi - im.start]
                if span_rows is not None:
                    span_rows[lo - start:hi - start] = im.start + im.encoded.num_tokens


class ImageChunks(AdmissionGate):
    """The scheduler's gate for images: a prefill chunk never ends inside an image attended both ways
    (`RequestImages.chunk_stop`)."""

    def chunk_end(self, seq, start: int, end: int) -> int:
        images = seq.request.prompt_content
        return end if images is None else images.chunk_stop(start, end)


class Multimodal(StepPart):
    """A vision-language model's image inputs (a `StepPart`, built from the options for a model with a vision
    tower): admission-time encoding and the per-step rows, which the step hands the forward."""

    takes_prompt_keys = (FIELD,)

    def __init__(self, cfg, *, cache_bytes: int, limit_per_prompt: int):
        self.cfg = cfg
        # The runner, weakly (its params hold the vision weights): the part is a static argument of the step
        # program, so JAX's tracing cache holds it past the engine's life.
        self._runner = lambda: None
        self._limits = None  # (the step's token budget, its logit rows): what one prefill step can hold
        self.cache = EncoderCache(cache_bytes)
        self.limit_per_prompt = limit_per_prompt
        self.seconds = {"preprocess": 0.0, "encode": 0.0}  # time spent, for benchmarks and stats
        self._time_lock = threading.Lock()

    def attach(self, engine) -> None:
        self._runner = weakref.ref(engine.runner)
        self._limits = (engine.scheduler.config.max_num_batched_tokens, engine.scheduler.config.logit_rows)

    @property
    def vision_weights(self):
        """The vision tower's weights, as the runner placed them (and as a weight update replaced them)."""
        return self._runner().params.vision

    def weights_replaced(self) -> None:
        self.cache = EncoderCache(self.cache.capacity_bytes)  # outputs of the old encoder

    def expand_prompt(self, prompt: dict, ids: list, params):
        """(ids with image placeholders expanded, `RequestImages`) of a dict prompt carrying "multi_modal_data":
        {"image": an image or a list of them}; None for a prompt without images."""
        data = prompt.get(FIELD)
        if data is None:
            return None
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidParameterError(FIELD, f"{FIELD}: expected {{'image': an image or a list of images}}, got "
                                               f"{type(data).__name__} {sorted(data) if isinstance(data, dict) else ''}")
        images = data.get("image")
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            return None
        return self.prepare(ids, images)

    def admit(self, request) -> None:
        """An image attended both ways is prefilled in one step (`RequestImages.chunk_stop`): refuses one
        larger than a step's token budget (or, with prompt logprobs, its logit rows), which could never run."""
        images = request.prompt_content
        if images is None or not images.bidirectional:
            return
        limit, what = self._limits[0], "max_num_batched_tokens"
        if request.params.prompt_logprobs is not None and self._limits[1] < limit:
            limit, what = self._limits[1], "the logit rows of one step (prompt_logprobs)"
        for i, im in enumerate(images.images):
            if im.encoded.num_tokens > limit:
                raise InvalidParameterError(FIELD, f"{FIELD}.image[{i}]: its {im.encoded.num_tokens} tokens are "
                                                   f"prefilled in one step and exceed {what}={limit}")

    def gate(self):
        return ImageChunks()

    def encoded(self, image, what: str) -> tuple[bytes, Encoded]:
        """(digest, encoder output) of one image; `what` names it in errors ("multi_modal_data.image[1]")."""
        if isinstance(image, EncodedImage):
            if image.encoded.embeds.shape[1:] != (self.cfg.hidden_size,):
                raise InvalidParameterError(FIELD, f"{what}: encoder output of shape {image.encoded.embeds.shape}, "
                                                   f"expected [tokens, {self.cfg.hidden_size}]")
            return image.digest, image.encoded
        t0 = time.perf_counter()
        try:
            rgb = to_rgb(image)
            digest = image_digest(rgb)
        except (TypeError, ValueError, OSError) as e:
            raise InvalidParameterError(FIELD, f"{what}: not an image: {e}") from None
        hit = self.cache.get(digest)
        if hit is not None:
            self._add("preprocess", time.perf_counter() - t0)
            return digest, hit
        try:
            processed = encoder.preprocess(rgb, self.cfg.vision)
        except ValueError as e:
            raise InvalidParameterError(FIELD, f"{what}: {e}") from None
        t1 = time.perf_counter()
        embeds = encoder_buckets.encode(self.vision_weights, processed, self.cfg.vision)
        t2 = time.perf_counter()
        self._add("preprocess", t1 - t0)
        self._add("encode", t2 - t1)
        entry = Encoded(embeds, processed.grid)
        self.cache.put(digest, entry)
        return digest, entry

    def warm_up(self) -> dict:
        """Compiles the encoder at each of its padded sizes (`encoder_buckets`)."""
        return encoder_buckets.warm_up(self.vision_weights, self.cfg.vision)

    def _add(self, key: str, seconds: float) -> None:
        with self._time_lock:
            self.seconds[key] += seconds

    def prepare(self, token_ids: list[int], images: list) -> tuple[list[int], RequestImages]:
        """(the prompt with each image's placeholders expanded, its `RequestImages`)."""
        if len(images) > self.limit_per_prompt:
            raise InvalidParameterError(FIELD, f"{FIELD}: {len(images)} images exceed limit_mm_per_prompt="
                                               f"{self.limit_per_prompt}")
        encoded = [self.encoded(im, f"{FIELD}.image[{i}]") for i, im in enumerate(images)]
        ids, starts = expand_placeholders(token_ids, self.cfg.image_token_id, [e.num_tokens for _, e in encoded])
        rope, delta = encoder.prompt_positions(self.cfg, ids, [e for _, e in encoded])
        placed = [PlacedImage(d, s, e) for (d, e), s in zip(encoded, starts)]
        return ids, RequestImages(placed, rope, delta, bidirectional=self.cfg.vision.bidirectional)

    # --- the step ------------------------------------------------------------------------------------
    def token_fields(self) -> tuple:
        """Every token's multimodal RoPE positions, the end of the image it is in (0: none) and its image
        embedding row (zeros outside images)."""
        return (TokenField("rope_positions", (3, -1)), TokenField("span_end"),
                TokenField("image_embeds", (-1, self.cfg.hidden_size), "float32"))

    def pack(self, batch) -> None:
        v = batch.views()
        rope, embeds = v["rope_positions"], v["image_embeds"]
        rope[:] = v["positions"][None, :]  # text: the three axes are the token's position
        spans = v["span_end"]
        spans[:] = 0  # text: no image, causal
        for seq, row, start, count in batch.token_spans:
            images = seq.request.prompt_content
            if images is not None:
                images.fill(rope[:, row:row + count], embeds[row:row + count], start, count, spans[row:row + count])

    def apply_to_inputs(self, views, md):
        """The rows' multimodal positions and image ends join the batch metadata; their embeddings replace the
        placeholder tokens' in the forward (`model.forward.merge_image_embeds`; a pipeline layout merges them
        before its first stage)."""
        md = dataclasses.replace(md, rope_positions=views["rope_positions"], span_end=views["span_end"])
        return md, {"image_embeds": views["image_embeds"]}

    def program_key(self):
        return ("multimodal", self.cfg.hidden_size)


def expand_placeholders(token_ids: list[int], image_token_id: int, counts: list[int]) -> tuple[list[int], list[int]]:
    """(ids, start of each image's placeholders): each run of `image_token_id` is one image's; a run of
    one token becomes `counts[i]` tokens, a run of exactly `counts[i]` stays (a prompt already expanded)."""
    runs, i, n = [], 0, len(token_ids)
    while i < n:
        if token_ids[i] == image_token_id:
            j = i
            while j < n and token_ids[j] == image_token_id:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    if len(runs) != len(counts):
        raise InvalidParameterError(FIELD, f"{FIELD}: {len(counts)} images given but the prompt has "
                                           f"{len(runs)} image placeholders")
    out, starts, prev = [], [], 0
    for k, ((a, b), count) in enumerate(zip(runs, counts)):
        if b - a not in (1, count):
            raise InvalidParameterError(FIELD, f"{FIELD}: image {k}'s placeholder run has {b - a} tokens; "
                                               f"expected 1 or {count}")
        out += token_ids[prev:a]
        starts.append(len(out))
        out += [image_token_id] * count
        prev = b
    out += token_ids[prev:]
    return out, starts
