"""The forward pass over a flattened ragged token batch: a family's blocks run over the layers.

One function serves prefill chunks and single-token decodes of many sequences
in the same call: tokens `[T]` (padded to a bucket), their positions and the
`BatchMetadata`. It writes each token's K/V into the paged cache, attends
through the chosen backend, and returns logits for the requested rows only,
together with the updated cache (donate it when jitting).

Sharding is optional and outside the model: `layout` (default None) is any
object with `constrain(x, logical_axes) -> x` and
`attention_backend(backend, cfg) -> backend` (`sharding.Layout` is one). With
None no sharding code runs and the program is exactly the single-device one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import get_backend
from model.blocks import norm
from model.cache import BatchMetadata, KVCache, StackedKVCache, layer_offsets
from model.config import LlamaConfig
from model.declarations import Weights
from model.families import family_for_config
from model.layer_select import layer_view, split_layers
from model.linear import grouped_matmul_kernel


def forward_hidden(params: Weights, cache: KVCache, tokens, md: BatchMetadata, cfg: LlamaConfig,
                   backend: str = "auto", layout=None, image_embeds=None):
    """Runs every layer; returns the final hidden states `[T, embed]` and the new cache. With a
    `StackedKVCache` (and `stack_layers` weights) the layers run as one `lax.scan`; with per-layer
    arrays, unrolled.

    The family's blocks (`model.families`) do the work (Llama's in `model.layers`, the other dense
    families' in `model.blocks`, a mixture of experts' in `model.families.moe_layers`). What differs
    between layers of one model (RoPE frequencies, sliding windows) is per-layer data,
    `blocks.layer_inputs(cfg)` with a leading `[layers]` dim, never a branch on the layer index (so it
    scans as it unrolls).

    `image_embeds` `[T, embed]` (a vision-language model, `model.vision`): the rows of the tokens that
    are image placeholders (`cfg.image_token_id` inside an image, `md.span_end`) take these embeddings
    instead of the token's; the other rows are ignored."""
    impl = get_backend(backend, head_dim=cfg.head_dim)
    with _grouped_kernel(impl, layout):
        return _forward_layers(params, cache, tokens, md, cfg, impl, layout, image_embeds)


def _grouped_kernel(impl, layout):
    """A backend with a kernel for the products with group-quantized weights (the Pallas ones) runs them
    (`model.linear`) on one device; over several XLA partitions them (a kernel's custom call would gather
    the sharded weights first)."""
    one_device = layout is None or getattr(getattr(layout, "mesh", None), "size", 0) == 1
    return grouped_matmul_kernel(impl.grouped_matmul if one_device else None)


def _logits(params, x, cfg, layout):
    with jax.named_scope("logits"):
        return family_for_config(cfg).blocks.logits(params, x, cfg, layout)


def _forward_layers(params, cache, tokens, md, cfg, impl, layout, image_embeds):
    blocks = family_for_config(cfg).blocks
    if layout is not None:
        impl = layout.attention_backend(impl, cfg)
    per_layer = blocks.layer_inputs(cfg)
    x = embed_rows(blocks, params, tokens, md, cfg, layout, image_embeds)
    if isinstance(cache, StackedKVCache):
        return _scan_layers(blocks, params, cache, x, md, per_layer, cfg, impl, layout)
    new_k, new_v = [], []
    for i, (layer, k_pages, v_pages) in enumerate(zip(params.layers, cache.k, cache.v)):
        # The scope names each layer's ops in the compiled HLO (collectives per layer, profiles).
        with jax.named_scope(f"layer_{i}"):
            inputs = jax.tree.map(lambda a: a[i], per_layer)
            x, k_pages, v_pages = blocks.attention(layer, x, k_pages, v_pages, md, inputs, cfg, impl, layout)
            x = blocks.mlp(layer, x, cfg, layout)
        new_k.append(k_pages)
        new_v.append(v_pages)
    return x, KVCache(k=new_k, v=new_v)


def embed_rows(blocks, params, tokens, md: BatchMetadata, cfg: LlamaConfig, layout=None, image_embeds=None):
    """The first layer's input `[T, embed]`: the family's token embeddings, an image's rows in place of its
    placeholders (`merge_image_embeds`), then what the batch adds (an encoder's positions and token types,
    `ForwardBlocks.position_embed`). Every driver of the layers starts here (the pipeline's too)."""
    with jax.named_scope("embed"):
        x = merge_image_embeds(blocks.embed(params, tokens, cfg, layout), tokens, image_embeds, cfg, md.span_end)
        if blocks.position_embed is not None:
            x = blocks.position_embed(params, x, md, cfg, layout)
    return x


def merge_image_embeds(x, tokens, image_embeds, cfg: LlamaConfig, span_end=None):
    """The token embeddings `x` `[T, embed]` with the image placeholder rows (`cfg.image_token_id`) taken
    from `image_embeds` `[T, embed]` (None: `x` as it is). Pipeline stages merge them the same way, on the
    first stage (`sharding.pipeline`).

    `span_end` `[T]` (the step's "span_end" rows, `serving.features.multimodal`): the end of the image each
    row is in, 0 outside every image. A placeholder id outside an image is a token the model generated
    (or a draft of one): it keeps its own embedding, as transformers embeds a generated token. None:
    every placeholder id is an image's."""
    if image_embeds is None:
        return x
    rows = tokens == cfg.image_token_id
    if span_end is not None:
        rows = rows & (span_end > 0)
    return jnp.where(rows[:, None], image_embeds.astype(x.dtype), x)


def _scan_layers(blocks, params: Weights, cache: StackedKVCache, x, md: BatchMetadata, per_layer, cfg: LlamaConfig,
                 impl, layout):
    """Every layer as one `lax.scan` step: stacked weights and the per-layer data are the scan's inputs, the
    hidden state and the whole stacked KV cache its carry (each layer writes and reads its own rows of it,
    in place). Weights left per layer (a list) are picked inside the body instead (`model.layer_select`)."""
    num_layers, num_pages, page_size = cache.num_layers, cache.num_pages, cache.page_size
    per_layer_weights = isinstance(params.layers, (list, tuple))
    layers = params.layers
    if per_layer_weights:
        matrices, layers = split_layers(params.layers)

    def layer_step(carry, xs):
        x, k, v = carry
        layer, inputs, i = xs
        if per_layer_weights:
            layer = layer_view(matrices, layer, i)
        layer_md = layer_offsets(md, i, num_layers, num_pages, page_size)
        x, k, v = blocks.attention(layer, x, k, v, layer_md, inputs, cfg, impl, layout)
        x = blocks.mlp(layer, x, cfg, layout)
        return (x, k, v), None

    with jax.named_scope("layers"):
        (x, k, v), _ = jax.lax.scan(layer_step, (x, cache.k, cache.v),
                                    (layers, per_layer, jnp.arange(num_layers, dtype=jnp.int32)))
    return x, StackedKVCache(k=k, v=v, num_layers=num_layers)


def forward(params: Weights, cache: KVCache, tokens, md: BatchMetadata, cfg: LlamaConfig,
            backend: str = "auto", layout=None, image_embeds=None):
    """Logits `[R, vocab]` (fp32) for rows `md.logits_indices`, and the updated cache (the LM head's product
    through the same grouped kernel as the layers')."""
    impl = get_backend(backend, head_dim=cfg.head_dim)
    with _grouped_kernel(impl, layout):
        x, cache = _forward_layers(params, cache, tokens, md, cfg, impl, layout, image_embeds)
        return _logits(params, x[md.logits_indices], cfg, layout), cache


def forward_with_hidden(params: Weights, cache: KVCache, tokens, md: BatchMetadata, cfg: LlamaConfig,
                        backend: str = "auto", layout=None, image_embeds=None):
    """`forward`'s logits, every row's hidden state after the final norm `[T, embed]` (what a pooler reads:
    `model.pooling`), and the updated cache: one forward serving both sampled and pooled rows."""
    impl = get_backend(backend, head_dim=cfg.head_dim)
    with _grouped_kernel(impl, layout):
        x, cache = _forward_layers(params, cache, tokens, md, cfg, impl, layout, image_embeds)
        return _logits(params, x[md.logits_indices], cfg, layout), final_hidden_norm(params, x, cfg), cache


def final_hidden_norm(params: Weights, x, cfg: LlamaConfig):
    """The final norm a pooler reads after (none for a family whose last layer ends normalized: an encoder)."""
    return x if params.final_norm is None else norm(x, params.final_norm, cfg)


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "layout"), donate_argnames=("cache",))
def forward_jit(params, cache, tokens, md, cfg: LlamaConfig, backend: str = "auto", layout=None, image_embeds=None):
    return forward(params, cache, tokens, md, cfg, backend, layout, image_embeds)
