"""The activation side of a layout: what the forward pass needs to run sharded.

`model.forward` takes an optional `layout` (default None: no sharding code runs
at all, so single-device programs are unchanged). A layout offers two things:

* `constrain(x, logical_axes)`: `with_sharding_constraint` on an activation,
  its spec resolved from the same rule table as the weights. The forward pins
  the residual stream to replicated between blocks, which makes each
  row-parallel projection (wo, w_down) end in exactly one all-reduce.
* `attention_backend(impl, cfg)`: the attention backend wrapped in a
  `shard_map` over the KV-head split. Attention and the KV write are
  per-head computations, so each device runs the unmodified backend (jnp
  reference or a Pallas kernel, which XLA could not partition by itself) on its
  own heads and pages with no communication. When KV heads are replicated
  (fewer than the TP degree) every device holds all of them and slices out
  the one its query heads use.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model.cache import CACHE_AXES
from model.config import ModelConfig
from model.families import family_for_config
from sharding.mesh import mesh_axis_sizes
from sharding.rules import Rules, load_rules, resolve_dims, spec_from_dims
from sharding.shardings import bytes_per_device, check_attention_groups, cache_shardings, param_shardings


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus a rule table. Hashable: pass it as a static argument of `jax.jit`."""

    mesh: Mesh
    rules: Rules

    @classmethod
    def create(cls, mesh: Mesh, rules="megatron") -> "Layout":
        return cls(mesh, load_rules(rules))

    @property
    def axis_sizes(self) -> dict[str, int]:
        return mesh_axis_sizes(self.mesh)

    @property
    def tensor_parallel_size(self) -> int:
        return self.axis_sizes.get("tensor", 1)

    def param_shardings(self, cfg: ModelConfig):
        """`Weights` of NamedSharding: pass to `init_params` / `load_checkpoint`."""
        return param_shardings(cfg, self.mesh, self.rules)

    def cache_shardings(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None):
        """`KVCache` of NamedSharding: pass to `init_cache`."""
        return cache_shardings(cfg, self.mesh, self.rules, num_pages, page_size, dtype)

    def cache_bytes_per_device(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> int:
        """What each device holds of a `num_pages` cache: its KV heads' share of every page."""
        return bytes_per_device(family_for_config(cfg).declare_cache(cfg, num_pages, page_size, dtype),
                                self.cache_shardings(cfg, num_pages, page_size, dtype))

    @property
    def replicated(self) -> NamedSharding:
        """For host inputs (tokens, metadata): placing them with one fixed sharding every
        step keeps the jitted step from recompiling on a sharding change."""
        return NamedSharding(self.mesh, PartitionSpec())

    def spec(self, logical_axes, shape, where: str = "activation") -> PartitionSpec:
        return spec_from_dims(resolve_dims(logical_axes, shape, self.rules, self.axis_sizes, where=where))

    def sharding(self, logical_axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    def constrain(self, x: jax.Array, logical_axes) -> jax.Array:
        # The token dimension is padded per bucket; its size is not part of the rules' check.
        shape = tuple(None if a == "tokens" else s for a, s in zip(logical_axes, x.shape))
        return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes, shape))

    def attention_backend(self, impl, cfg: ModelConfig):
        """`impl` (an `AttentionBackend`) run per device on its own KV heads."""
        check_attention_groups(self.rules, cfg, self.axis_sizes)
        q_dims = resolve_dims(("q_heads",), (cfg.num_heads,), self.rules, self.axis_sizes, where="q")[0]
        kv_dims = resolve_dims(("kv_heads",), (cfg.num_kv_heads,), self.rules, self.axis_sizes, where="kv")[0]
        q_ways = 1
        for m in q_dims.mesh_axes:
            q_ways *= self.axis_sizes[m]
        if q_ways == 1:
            return impl  # nothing is split: the backend runs as it is (GSPMD replicates it)
        # Replicated KV heads with split query heads: device i's query heads all use
        # KV head i // (q_ways // kv_heads) (q_ways is a multiple of kv_heads by the rules).
        kv_replicated = not kv_dims.mesh_axes
        q_spec = self.spec(("tokens", "q_heads", "head_dim"), (None, cfg.num_heads, cfg.head_dim))
        kv_spec = self.spec(("tokens", "kv_heads", "head_dim"), (None, cfg.num_kv_heads, cfg.head_dim))
        page_spec = self.spec(CACHE_AXES, (None, None, cfg.num_kv_heads, cfg.head_dim))
        rep = PartitionSpec()
        heads_per_kv_copy = q_ways // cfg.num_kv_heads if kv_replicated else 1
        q_axis = q_dims.mesh_axes[0] if len(q_dims.mesh_axes) == 1 else q_dims.mesh_axes

        # Scales of a quantized cache ([pages, page_size, kv_heads]) split with their KV heads.
        scale_spec = self.spec(CACHE_AXES[:3], (None, None, cfg.num_kv_heads))

        def local_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *rest, sm_scale,
                            soft_cap, windowed, spans):
            # rest: (k_scale, v_scale) of a quantized cache, then the window when there is one, then the
            # span ends when there are.
            span_end, rest = (rest[-1], rest[:-1]) if spans else (None, rest)
            scales, window = (rest[:-1], rest[-1]) if windowed else (rest, None)
            extra = {} if window is None and soft_cap is None else dict(window=window, soft_cap=soft_cap)
            if span_end is not None:
                extra["span_end"] = span_end
            if kv_replicated:
                kv_head = jax.lax.axis_index(q_axis) // heads_per_kv_copy
                k_pages = jax.lax.dynamic_slice_in_dim(k_pages, kv_head, 1, axis=2)
                v_pages = jax.lax.dynamic_slice_in_dim(v_pages, kv_head, 1, axis=2)
                scales = tuple(jax.lax.dynamic_slice_in_dim(s, kv_head, 1, axis=2) for s in scales)
            if scales:
                return impl.attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
                                      sm_scale=sm_scale, k_scale=scales[0], v_scale=scales[1], **extra)
            return impl.attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
                                  sm_scale=sm_scale, **extra)

        def attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale=None,
                      k_scale=None, v_scale=None, window=None, soft_cap=None, span_end=None):
            # check_vma=False: custom kernels inside need not carry replication rules; the
            # specs below are exact (outputs vary only along the split head axis).
            scales = () if k_scale is None else (k_scale, v_scale)
            windows = () if window is None else (window,)  # a traced per-layer scalar, replicated
            spans = () if span_end is None else (span_end,)  # per token, replicated like the lengths
            f = jax.shard_map(functools.partial(local_attention, sm_scale=sm_scale, soft_cap=soft_cap,
                                                windowed=window is not None, spans=span_end is not None),
                              mesh=self.mesh,
                              in_specs=(q_spec, page_spec, page_spec, rep, rep, rep, rep)
                              + (scale_spec,) * len(scales) + (rep,) * len(windows) + (rep,) * len(spans),
                              out_specs=q_spec, check_vma=False)
            return f(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *scales, *windows, *spans)

        def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, k_scale=None, v_scale=None):
            scales = () if k_scale is None else (k_scale, v_scale)
            f = jax.shard_map(impl.write_kv, mesh=self.mesh,
                              in_specs=(page_spec, page_spec, kv_spec, kv_spec, rep) + (scale_spec,) * len(scales),
                              out_specs=(page_spec, page_spec) + (scale_spec,) * len(scales), check_vma=False)
            return f(k_pages, v_pages, k_new, v_new, slot_mapping, *scales)

        return dataclasses.replace(impl, name=f"{impl.name}@tp{q_ways}", attention=attention, write_kv=write_kv)


    def expert_parallel(self, experts_fn, cfg: ModelConfig):
        """A mixture of experts' expert computation run per device on its experts
        (`sharding.experts`)."""
        from sharding.experts import expert_parallel

        return expert_parallel(self, experts_fn, cfg)


def make_layout(mesh: Mesh, rules="megatron") -> Layout:
    return Layout.create(mesh, rules)
