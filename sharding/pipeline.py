"""Pipeline parallelism: contiguous layer stages over the `pipeline` mesh axis.

Placement. With `p` stages and `L` layers, stage `s` owns global layers
`s*L/p .. (s+1)*L/p - 1`. The stage weights are held per stage-local layer
`j`: each weight is one array holding the `p` stages' copies of that weight
concatenated along its first dimension (rows `s*n .. (s+1)*n - 1` are global
layer `s*L/p + j`), that dimension sharded over `pipeline` first and then over
whatever the rule table gives it (under megatron `tensor` for the output dim
of the column-parallel wq/wk/wv/w_gate/w_up; nothing for the embed rows of
`wo` and `w_down`, whose input dim carries `tensor`), the other
dimensions exactly as for the unstaged weight. So every device holds only its
stage's layers (and only its tensor shard of them), and inside the pipeline's
`shard_map` each stage sees its own weight with the unstaged shape: nothing is
indexed, reshaped or copied per step. (A separate leading `[p]` dimension
would need a squeeze inside the stage; with one KV head per device, XLA then
copied the whole KV pool in and out of the step, as layouts of two size-1
dimensions did not match.) The paged KV cache is staged the same way: per
stage-local layer, `[p * pages, page_size, kv_heads, head_dim]` with the page
axis split over `pipeline`, so every stage has pages `0 .. pages-1` of its own
layers under the same page ids (the block manager is unchanged). KV transfer
(`serving.disaggregation.kv_transfer`) gathers and scatters it the same way,
each stage in its own block, global layer `l` being stage `l // (L/p)`'s
local layer `l % (L/p)`, so a payload has the unstaged `[layers, ...]` order.
Quantized weights and pages (`model.quant.QuantizedArray`) are staged field by
field: data and scales each concatenated along their own first dimension (a
page's scales `[p * pages, page_size, kv_heads]` split like its pages), so they
enter the stages, the tick loop and copy-on-write as ordinary pytree leaves.

The embedding table, the final norm and the `lm_head` are replicated over
stages (and split over `tensor` as usual). That costs each device one extra
copy of its tensor shard of the embedding and head (Llama-3 405B at TP=8:
2 x 128,256 x 16,384 x 2 B / 8 = 1.05 GB per device), in exchange for a step
with no stage-to-stage transfer of the token ids or of the logits: the embedding
lookup and the logits run outside the pipelined region under ordinary
tensor-parallel sharding.

Schedule (`pipeline_forward`). The padded token batch `[T]` is cut into `m`
(at most `T`) contiguous microbatches of `ceil(T/m)` tokens (token ranges, not sequences,
so every microbatch has the same static shape and equal work). Per-microbatch
attention metadata is derived on the device from the step's `BatchMetadata`
(`microbatch_metadata`), so the host packer and what is broadcast to other
processes are the same as without pipelining. Inside one `jax.shard_map`
that is manual over `pipeline` only (`tensor` stays automatic, so the
tensor-parallel constraints and the per-head attention `shard_map` of
`sharding.Layout` work unchanged inside a stage), a loop of `m + p - 1` ticks
runs: at tick `t` stage `s` runs its layers on microbatch `t - s` and hands the
result to stage `s + 1` with `jax.lax.ppermute`. Ticks where `t - s` is not a
microbatch (the fill and drain bubble) compute on stale data with every KV
write dropped and the result discarded: SPMD stages all run the same program.

Causality across microbatches: a sequence cut by a microbatch boundary has its
earlier tokens in an earlier microbatch, which reaches every stage (so every
layer) one tick before the later microbatch; their K/V are in the cache when
the later tokens attend at the same layer.

Families. The stages hold the family's own declared layer (`Layer`, a mixture
of experts' `MoeLayer`; optional fields such as biases and q/k norms staged
like the rest, or None in every stage) and run its blocks
(`family_for_config(cfg).blocks`), the functions `model.forward` runs without
stages. Per-layer data (`blocks.layer_inputs`: RoPE frequencies, sliding
windows) is sliced per stage (`stage_layer_inputs`). A mixture of experts'
MLP reaches `sharding.experts` through the stage layout's `expert_parallel`,
so experts are split over `tensor` inside each stage as the rule table says.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels_pallas import get_backend
from model.cache import BatchMetadata, KVCache
from model.config import ModelConfig
from model.families import family_for_config
from model.forward import embed_rows, final_hidden_norm
from model.lora import attach_layer, slot_axes
from model.params import is_array_info, pytree_dataclass
from sharding.layout import Layout
from sharding.mesh import MeshError, make_mesh, mesh_axis_sizes
from sharding.rules import RuleError, Rules, load_rules
from sharding.shardings import bytes_per_device

PIPELINE = "pipeline"


class PipelineError(ValueError):
    """A pipeline layout that cannot run this model on these devices."""


@pytree_dataclass
class StagedWeights:
    """Weights with the layers regrouped by stage: `stages[j]` is a layer of the model's own
    kind (`model.params.Layer`, a mixture of experts' `MoeLayer`) whose every array is the `p`
    stages' copies concatenated along the first dimension (stage `s`'s block is global layer
    `s * L/p + j`); a field the family leaves out (None: a bias, a q/k norm) stays None.
    `embed`, `final_norm` and `lm_head` keep the names of `model.params.Weights`, so the
    family's `embed` and `logits` blocks apply to them unchanged."""

    embed: object
    stages: list
    final_norm: object
    lm_head: object
    vision: object = None  # a vision-language model's image encoder, as `param_shardings` placed it (every device)


@dataclasses.dataclass(frozen=True)
class _StageLayout(Layout):
    """A tensor-parallel `Layout` on the mesh seen inside the pipeline's `shard_map`, where
    `pipeline` is a manual axis. Built during tracing; never a jit argument."""

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """A (data, pipeline, tensor) mesh, a rule table and the number of microbatches.

    Hashable: a static argument of `jax.jit`. Offers what `serving.core.model_runner`
    expects of a layout (`param_shardings`, `cache_shardings`, `replicated`), plus
    `stage_params` / `init_cache` for the staged pytrees and `forward`, the
    pipelined forward pass.
    """

    mesh: Mesh
    rules: Rules
    num_microbatches: int = 1

    @classmethod
    def create(cls, mesh: Mesh, rules="megatron", num_microbatches: int = 1) -> "PipelineLayout":
        if not isinstance(num_microbatches, (int, np.integer)) or isinstance(num_microbatches, bool) \
                or num_microbatches < 1:
            raise PipelineError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
        return cls(mesh, load_rules(rules), int(num_microbatches))

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def axis_sizes(self) -> dict[str, int]:
        return mesh_axis_sizes(self.mesh)

    @property
    def pipeline_parallel_size(self) -> int:
        return self.axis_sizes[PIPELINE]

    @property
    def tensor_parallel_size(self) -> int:
        return self.axis_sizes.get("tensor", 1)

    @property
    def tensor_layout(self) -> Layout:
        """Tensor parallelism on the whole mesh: used outside the pipelined region
        (embedding, logits), where everything is replicated over `pipeline`."""
        return Layout(self.mesh, self.rules)

    def check(self, cfg: ModelConfig) -> None:
        """Raises `PipelineError` when the model's layers do not split into the stages. Any
        registered family stages (`model.families`): every layer of one model declares the same
        weights, and what differs between layers is per-layer data the stages slice."""
        p = self.pipeline_parallel_size
        family_for_config(cfg)  # an unknown architecture: the registry's error, naming what runs
        if cfg.num_layers % p:
            raise PipelineError(f"pipeline_parallel_size={p} must divide the model's {cfg.num_layers} layers "
                                f"(each stage holds an equal, contiguous run of layers)")
        if any(PIPELINE in axes for _, axes in self.rules.axes):
            raise RuleError(f"rule table {self.rules.name!r} maps a logical axis to {PIPELINE!r}, which "
                            "pipeline parallelism reserves for stages")
        if cfg.bidirectional:  # `StagedWeights` carries a decoder's embed / final_norm / lm_head, not these
            raise PipelineError(f"{cfg.architecture} is an encoder: its position and token-type embeddings are not "
                                "staged; serve it without pipeline_parallel_size")

    def layers_per_stage(self, cfg: ModelConfig) -> int:
        self.check(cfg)
        return cfg.num_layers // self.pipeline_parallel_size

    def stage_of_layer(self, cfg: ModelConfig, layer: int) -> int:
        return layer // self.layers_per_stage(cfg)

    def stage_mesh(self, stage: int) -> Mesh:
        """The devices of one stage, as a mesh with the same three axes (pipeline of size 1)."""
        return Mesh(self.mesh.devices[:, stage:stage + 1, :], self.mesh.axis_names,
                    axis_types=self.mesh.axis_types)

    # --- shardings -----------------------------------------------------------------------------
    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def _staged_spec(self, info, where: str) -> PartitionSpec:
        """The unstaged spec with `pipeline` put in front of the first dimension's mesh axes."""
        spec = tuple(self.tensor_layout.spec(info.logical_axes, info.shape, where=where))
        spec += (None,) * (len(info.shape) - len(spec))
        first = spec[0]
        first = () if first is None else (first,) if isinstance(first, str) else tuple(first)
        return PartitionSpec((PIPELINE,) + first if first else PIPELINE, *spec[1:])

    def param_shardings(self, cfg: ModelConfig):
        """Shardings of the unstaged `Weights` (e.g. to restore a checkpoint into): each layer on
        its stage's devices, split over `tensor` by the rules; the rest on every device."""
        from sharding.shardings import param_shardings as tp_param_shardings

        self.check(cfg)
        full = tp_param_shardings(cfg, self.mesh, self.rules)  # validates the rules on this mesh
        per_stage = self.layers_per_stage(cfg)
        layers = [jax.tree.map(lambda sh, s=self.stage_mesh(i // per_stage): NamedSharding(s, sh.spec), layer)
                  for i, layer in enumerate(full.layers)]
        return dataclasses.replace(full, layers=layers)

    def staged_shardings(self, cfg: ModelConfig) -> StagedWeights:
        """Shardings of the `StagedWeights`: every layer weight's first dimension split over
        `pipeline` (then over its own mesh axes)."""
        self.check(cfg)
        layer_decl = family_for_config(cfg).declare_weights(cfg).layers[0]

        def staged(decl, name):  # an ArrayInfo, a QuantizedArray of two (data and scale: each staged), or None
            return jax.tree.map(lambda info: NamedSharding(self.mesh, self._staged_spec(info, name)), decl,
                                is_leaf=is_array_info)

        # The family's own layer class and fields (biases, q/k norms, experts, ...): absent ones stay None.
        stage_layer = type(layer_decl)(**{f.name: staged(getattr(layer_decl, f.name), f"layers.{f.name}")
                                          for f in dataclasses.fields(layer_decl)})
        full = self.tensor_layout.param_shardings(cfg)
        return StagedWeights(embed=full.embed, stages=[stage_layer] * self.layers_per_stage(cfg),
                             final_norm=full.final_norm, lm_head=full.lm_head, vision=getattr(full, "vision", None))

    def cache_shardings(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> KVCache:
        """Shardings of the staged cache: per stage-local layer `[p * pages, slot, kv_heads, head_dim]`,
        the page axis split over `pipeline` (a quantized cache's `[p * pages, slot, kv_heads]` scales
        likewise, so every page keeps its scales on its stage)."""
        info = family_for_config(cfg).declare_cache(cfg, num_pages, page_size, dtype).k[0]
        sh = jax.tree.map(lambda i: NamedSharding(self.mesh, self._staged_spec(i, "cache")), info,
                          is_leaf=is_array_info)
        n = self.layers_per_stage(cfg)
        return KVCache(k=[sh] * n, v=[sh] * n)

    # --- building the staged pytrees ---------------------------------------------------------------
    def stage_params(self, cfg: ModelConfig, params) -> StagedWeights:
        """Regroups `Weights` by stage. Each layer is first put on its stage's devices (a no-op
        for weights restored with `param_shardings`); the `[p]` arrays are then assembled from
        those per-device buffers (no copy), so nothing crosses stages and no device ever
        holds another stage's layers."""
        params = jax.device_put(params, self.param_shardings(cfg))
        targets = self.staged_shardings(cfg)
        per_stage, p = self.layers_per_stage(cfg), self.pipeline_parallel_size
        stages = []
        for j in range(per_stage):
            members = [params.layers[s * per_stage + j] for s in range(p)]
            stages.append(jax.tree.map(lambda target, *arrays: _stack_stage_arrays(arrays, target),
                                       targets.stages[j], *members))
        return StagedWeights(embed=params.embed, stages=stages, final_norm=params.final_norm,
                             lm_head=params.lm_head, vision=getattr(params, "vision", None))

    def staged_cache_layer(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None):
        """The declaration of one stage-local cache layer (K or V): pages (and the scales of a
        quantized cache) `[p * num_pages, ...]`, the page axis holding every stage's block."""
        p = self.pipeline_parallel_size
        info = family_for_config(cfg).declare_cache(cfg, num_pages, page_size, dtype).k[0]
        return jax.tree.map(lambda i: dataclasses.replace(i, shape=(p * i.shape[0],) + tuple(i.shape[1:])), info,
                            is_leaf=is_array_info)

    def cache_bytes_per_device(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> int:
        """What each device holds of a `num_pages` cache: its stage's layers, its KV heads."""
        per_layer = bytes_per_device(self.staged_cache_layer(cfg, num_pages, page_size, dtype),
                                     self.cache_shardings(cfg, num_pages, page_size, dtype).k[0])
        return 2 * self.layers_per_stage(cfg) * per_layer  # K and V

    def init_cache(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> KVCache:
        layer = self.staged_cache_layer(cfg, num_pages, page_size, dtype)
        shardings = self.cache_shardings(cfg, num_pages, page_size, dtype)

        def zeros():
            return jax.tree.map(lambda i: jnp.zeros(i.shape, i.dtype), layer, is_leaf=is_array_info)

        def build():
            n = len(shardings.k)
            return KVCache(k=[zeros() for _ in range(n)], v=[zeros() for _ in range(n)])

        return jax.jit(build, out_shardings=shardings)()

    # --- LoRA adapter slots (model.lora) -----------------------------------------------------------
    def stage_lora_slots(self, cfg: ModelConfig, params: StagedWeights, decl: dict):
        """The LoRA slots of `model.lora.declare_slots` (`[layers, ...]` leaves) staged as the layers are:
        `[p, layers / p, ...]`, row `[s, j]` being global layer `s * L/p + j`, split over `pipeline` on the
        first dim and, within a stage, A like its base weight's input dim and B like its output dim (as
        `model.lora.slot_shardings` places them without stages). Returns (declaration, shardings)."""
        p, per_stage = self.pipeline_parallel_size, self.layers_per_stage(cfg)
        layer = params.stages[0]
        staged, shardings = {}, {}
        for name, (a, b) in decl.items():
            _, in_axes, out_axes = slot_axes(layer, name, drop=(PIPELINE,))
            staged[name] = tuple(jax.ShapeDtypeStruct((p, per_stage) + x.shape[1:], x.dtype) for x in (a, b))
            shardings[name] = (NamedSharding(self.mesh, PartitionSpec(PIPELINE, None, None, in_axes)),
                               NamedSharding(self.mesh, PartitionSpec(PIPELINE, None, out_axes, None)))
        return staged, shardings

    # --- the forward pass ---------------------------------------------------------------------------
    def forward(self, params: StagedWeights, cache: KVCache, tokens, md: BatchMetadata, cfg: ModelConfig,
                backend: str = "auto", image_embeds=None, lora=None, with_hidden: bool = False):
        return pipeline_forward(params, cache, tokens, md, cfg, backend, self, image_embeds=image_embeds, lora=lora,
                                with_hidden=with_hidden)


def _stack_stage_arrays(arrays, target: NamedSharding) -> jax.Array:
    """One array from p arrays concatenated along dimension 0, array `s` living on stage `s`'s
    devices: the staged array is assembled from the very same device buffers."""
    shape = (len(arrays) * arrays[0].shape[0],) + arrays[0].shape[1:]
    by_device = {}
    for a in arrays:
        for shard in a.addressable_shards:
            by_device[shard.device] = shard.data
    pieces = [by_device[d] for d in target.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, target, pieces)


def make_pipeline_layout(pipeline: int, tensor: int = 1, num_microbatches: int = 1, rules="megatron",
                         devices=None) -> PipelineLayout:
    """A pipeline layout over the first `pipeline * tensor` devices (or `devices`)."""
    if not isinstance(pipeline, (int, np.integer)) or pipeline < 1:
        raise PipelineError(f"pipeline_parallel_size must be a positive integer, got {pipeline!r}")
    try:
        mesh = make_mesh(tensor=tensor, pipeline=pipeline, devices=devices)
    except MeshError as e:
        raise MeshError(f"pipeline_parallel_size={pipeline} x tensor_parallel_size={tensor}: {e}") from None
    return PipelineLayout.create(mesh, rules, num_microbatches)


# --- the pipelined step ------------------------------------------------------------------------------


def microbatch_metadata(md: BatchMetadata, num_microbatches: int, microbatch_tokens: int) -> BatchMetadata:
    """The step's metadata cut into `m` contiguous token ranges of `microbatch_tokens` each.

    Every field gets a leading `[m]` dimension except `block_tables` and `num_seqs`, which
    all microbatches share. Sequence i keeps its index in every microbatch; in microbatch
    `k` (tokens `a..b-1`) its query rows are its tokens inside `[a, b)` and its KV length
    ends at the last of them, so attention sees exactly the keys before and at each query.
    A sequence with no tokens in the range gets q and kv length 0 (no work).
    `positions` and `slot_mapping` (and multimodal `rope_positions` `[3, T]`) must already be padded to
    `m * microbatch_tokens`.
    """
    m, n = num_microbatches, microbatch_tokens
    start = (jnp.arange(m, dtype=jnp.int32) * n)[:, None]
    end = start + n
    cu = jnp.clip(md.cu_q_lens[None, :], start, end) - start  # [m, S+1]
    seq_end = md.cu_q_lens[None, 1:]
    kv = md.kv_lens[None, :] - (seq_end - jnp.minimum(seq_end, end))
    q_len = cu[:, 1:] - cu[:, :-1]
    kv = jnp.where(q_len > 0, kv, 0)
    rope = None if md.rope_positions is None else md.rope_positions.reshape(3, m, n).transpose(1, 0, 2)
    return BatchMetadata(positions=md.positions.reshape(m, n), slot_mapping=md.slot_mapping.reshape(m, n),
                         cu_q_lens=cu, kv_lens=kv, block_tables=md.block_tables, num_seqs=md.num_seqs,
                         logits_indices=md.logits_indices, rope_positions=rope,
                         span_end=None if md.span_end is None else md.span_end.reshape(m, n))


def _pad_to(x, length: int, value):
    return jnp.pad(x, (0, length - x.shape[0]), constant_values=value)


def stage_layer_inputs(per_layer, stage, num_stages: int):
    """This stage's slice of the family's per-layer data (`ForwardBlocks.layer_inputs`: leaves
    `[layers, ...]`, e.g. RoPE frequencies and sliding windows): leaves `[layers / p, ...]`,
    row `j` being global layer `stage * L/p + j`. `stage` is traced (the pipeline's axis index);
    None leaves (no window) stay None."""
    def pick(a):
        blocks = a.reshape((num_stages, a.shape[0] // num_stages) + a.shape[1:])
        return jax.lax.dynamic_index_in_dim(blocks, stage, axis=0, keepdims=False)
    return jax.tree.map(pick, per_layer)


def pipeline_forward(params: StagedWeights, cache: KVCache, tokens, md: BatchMetadata, cfg: ModelConfig,
                     backend: str, layout: PipelineLayout, num_ticks: int | None = None, image_embeds=None,
                     lora=None, with_hidden: bool = False):
    """Logits `[R, vocab]` (fp32) for rows `md.logits_indices`, and the updated staged cache; `with_hidden`:
    (logits, every row's hidden state after the final norm `[T, embed]`, cache), as
    `model.forward.forward_with_hidden` (a pooling step: the last stage shares all its rows, not only the
    logit rows).

    `lora` (LoRA adapters, `model.lora`): (the staged slots of `PipelineLayout.stage_lora_slots`, each
    token's slot `[T]`, the slot rank), or None. Each stage reads its own layers' slots, and every
    microbatch its tokens' slots (padding runs the base model), so a stage's layers add the same
    deltas as the unstaged forward does.

    The layers are the model family's own blocks (`family_for_config(cfg).blocks`: its
    `embed`, `attention`, `mlp`, `logits` and `layer_inputs`), the very functions
    `model.forward` runs unpipelined, so every registered family runs here with one
    implementation of each layer.

    `num_ticks` (default `m + p - 1`, the full schedule) exists for the benchmark, which
    times a schedule without the fill/drain ticks to measure what they cost; any other
    value gives wrong results.

    A vision-language model's image rows (`image_embeds` `[T, embed]`) replace the placeholder tokens'
    embeddings before the first stage (as `model.forward` does), and its multimodal RoPE positions
    (`md.rope_positions` `[3, T]`) are cut into microbatches like the positions, for every stage. Where
    image tokens attend both ways (`md.span_end`, Gemma 3) the step runs as one microbatch.
    """
    blocks = family_for_config(cfg).blocks
    T = tokens.shape[0]
    # More microbatches than tokens would only add empty ticks (small decode buckets). A model whose image
    # tokens attend both ways (Gemma 3) runs each step as one microbatch: a microbatch boundary inside an
    # image would run the image's first tokens before its last ones exist, so they could not see them.
    both_ways = cfg.vision is not None and getattr(cfg.vision, "bidirectional", False) and md.span_end is not None
    p, m = layout.pipeline_parallel_size, 1 if both_ways else min(layout.num_microbatches, T)
    ticks = m + p - 1 if num_ticks is None else num_ticks
    tp = layout.tensor_layout
    mb_tokens = -(-T // m)
    padded = mb_tokens * m
    pages, page_size = cache.k[0].shape[0] // p, cache.k[0].shape[1]
    drop_slot = pages * page_size  # one past the end: every cache write drops it
    lora_slots, lora_rank = {}, 0
    token_slots = jnp.zeros((m, 0), jnp.int32)
    if lora is not None:
        lora_slots, token_slots, lora_rank = lora
        token_slots = _pad_to(token_slots, padded, -1).reshape(m, mb_tokens)
    x = embed_rows(blocks, params, tokens, md, cfg, tp, image_embeds)
    x = jnp.pad(x, ((0, padded - T), (0, 0)))
    rope = None if md.rope_positions is None else jnp.pad(md.rope_positions, ((0, 0), (0, padded - T)))
    md = dataclasses.replace(md, positions=_pad_to(md.positions, padded, 0),
                             slot_mapping=_pad_to(md.slot_mapping, padded, drop_slot), rope_positions=rope,
                             span_end=_pad_to(md.span_end, padded, 0) if both_ways else None)
    mmd = microbatch_metadata(md, m, mb_tokens)
    x = x.reshape(m, mb_tokens, cfg.hidden_size)

    def run_stages(stages, k_cache, v_cache, x_in, mmd, lora_slots, token_slots):
        stage = jax.lax.axis_index(PIPELINE)
        inner = _StageLayout(jax.sharding.get_abstract_mesh(), layout.rules)
        impl = inner.attention_backend(get_backend(backend, head_dim=cfg.head_dim), cfg)
        per_layer = stage_layer_inputs(blocks.layer_inputs(cfg), stage, p)
        layers, ks, vs = stages, k_cache, v_cache  # this stage's own blocks, unstaged shapes

        def tick(t, carry):
            state, outs, ks, vs = carry
            k_mb = t - stage
            valid = (k_mb >= 0) & (k_mb < m)
            i = jnp.clip(k_mb, 0, m - 1)
            md_i = BatchMetadata(positions=mmd.positions[i],
                                 slot_mapping=jnp.where(valid, mmd.slot_mapping[i], drop_slot),
                                 cu_q_lens=mmd.cu_q_lens[i], kv_lens=mmd.kv_lens[i],
                                 block_tables=mmd.block_tables, num_seqs=mmd.num_seqs, logits_indices=None,
                                 rope_positions=None if mmd.rope_positions is None else mmd.rope_positions[i],
                                 span_end=None if mmd.span_end is None else mmd.span_end[i])
            h = jnp.where(stage == 0, x_in[i], state)
            new_ks, new_vs = [], []
            for j, (layer, k_pages, v_pages) in enumerate(zip(layers, ks, vs)):
                if lora_slots:  # this stage's slots of its layer j, [1, layers / p, ...] here
                    layer = attach_layer(layer, {name: (a[0, j], b[0, j]) for name, (a, b) in lora_slots.items()},
                                         token_slots[i], lora_rank)
                with jax.named_scope(f"stage_layer_{j}"):
                    inputs = jax.tree.map(lambda a: a[j], per_layer)
                    h, k_pages, v_pages = blocks.attention(layer, h, k_pages, v_pages, md_i, inputs, cfg, impl,
                                                           inner)
                    h = blocks.mlp(layer, h, cfg, inner)
                new_ks.append(k_pages)
                new_vs.append(v_pages)
            keep = valid & (stage == p - 1)
            outs = outs.at[i].set(jnp.where(keep, h, outs[i]))
            state = jax.lax.ppermute(h, PIPELINE, [(s, s + 1) for s in range(p - 1)])
            return state, outs, new_ks, new_vs

        state = jnp.zeros((mb_tokens, cfg.hidden_size), x_in.dtype)
        outs = jnp.zeros((m, mb_tokens, cfg.hidden_size), x_in.dtype)
        _, outs, ks, vs = jax.lax.fori_loop(0, ticks, tick, (state, outs, ks, vs))
        # Only the last stage holds the final hidden states: select the logit rows there and
        # share them with every stage (an all-reduce of [rows, embed] over `pipeline`).
        every = outs.reshape(padded, cfg.hidden_size)
        rows = every[:T] if with_hidden else every[mmd.logits_indices]
        rows = jax.lax.psum(jnp.where(stage == p - 1, rows, jnp.zeros_like(rows)), PIPELINE)
        return rows, ks, vs

    staged = PartitionSpec(PIPELINE)
    rep = PartitionSpec()
    run = jax.shard_map(run_stages, mesh=layout.mesh, axis_names={PIPELINE}, check_vma=False,
                        in_specs=(staged, staged, staged, rep, rep, staged, rep), out_specs=(rep, staged, staged))
    rows, new_k, new_v = run(params.stages, cache.k, cache.v, x, mmd, lora_slots, token_slots)
    hidden = None
    if with_hidden:  # every row came back: the logit rows are some of them
        hidden, rows = rows, rows[md.logits_indices]
    with jax.named_scope("logits"):
        logits = blocks.logits(params, tp.constrain(rows, ("tokens", "embed")), cfg, tp)
    if with_hidden:
        return logits, final_hidden_norm(params, tp.constrain(hidden, ("tokens", "embed")), cfg), KVCache(k=new_k, v=new_v)
    return logits, KVCache(k=new_k, v=new_v)


def copy_staged_pages(cache: KVCache, src, dst, layout: PipelineLayout) -> KVCache:
    """Copy-on-write of whole pages src[i] -> dst[i] on every stage, each stage in its own
    block of the page axis (dst == pages is padding and dropped). Every cache leaf is indexed
    by page first, so a quantized cache's scales are copied with their pages."""

    def local(k, v):
        copy = lambda x: x.at[dst].set(x[src], mode="drop")  # noqa: E731
        return jax.tree.map(copy, k), jax.tree.map(copy, v)

    staged = PartitionSpec(PIPELINE)
    k, v = jax.shard_map(local, mesh=layout.mesh, axis_names={PIPELINE}, check_vma=False,
                         in_specs=(staged, staged), out_specs=(staged, staged))(cache.k, cache.v)
    return KVCache(k=k, v=v)


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "layout", "num_ticks"), donate_argnames=("cache",))
def pipeline_forward_jit(params, cache, tokens, md, cfg: ModelConfig, backend: str, layout: PipelineLayout,
                         num_ticks: int | None = None):
    return pipeline_forward(params, cache, tokens, md, cfg, backend, layout, num_ticks)
