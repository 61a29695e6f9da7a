"""The model runner for pipeline layouts (`sharding.pipeline.PipelineLayout`).

Same step, same buckets, same host inputs as `ModelRunner`; what differs is
the device state: params are `StagedWeights` (each layer on its stage's
devices) and the KV cache holds, per stage-local layer, one `[p * pages, ...]`
array whose page axis is split over `pipeline`. The block manager is unchanged: page ids are
the same on every stage, each stage holding those pages for its own layers.
The step itself is `model_runner`'s: the layout supplies the forward pass.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from sharding.pipeline import copy_staged_pages
from serving.input_batch import StepShape
from serving.model_runner import ModelRunner


_copy_staged_jit = jax.jit(copy_staged_pages, static_argnames=("layout",), donate_argnums=(0,))


class PipelineRunner(ModelRunner):
    """`ModelRunner` over staged params and a staged KV cache."""

    def place(self, params, cache_dtype=None):
        staged = self.layout.stage_params(self.cfg, params)
        cache = self.layout.init_cache(self.cfg, self.num_pages, self.page_size, cache_dtype)
        return staged, cache

    def _copy(self, src, dst):
        if self.dispatch_hook is not None:  # multi-host: announced like every device call
            self.dispatch_hook("copy", src, dst)
        self.cache = _copy_staged_jit(self.cache, *self._host_inputs(src, dst), layout=self.layout)
        return self.cache

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        for i in range(0, len(copies), self.copy_sizes[-1]):
            chunk = copies[i:i + self.copy_sizes[-1]]
            size = next(s for s in self.copy_sizes if s >= len(chunk))
            src = np.zeros(size, np.int32)
            dst = np.full(size, self.num_pages, np.int32)
            src[:len(chunk)] = [c[0] for c in chunk]
            dst[:len(chunk)] = [c[1] for c in chunk]
            self._copy(src, dst)

    def warm_up(self) -> dict:
        t0 = time.perf_counter()
        before = self.compilation_count()
        pad = self.num_pages * self.page_size
        for T, S, P in self.buckets.all_shapes():
            shape = StepShape(T, S, P)
            ibuf, fbuf, _ = shape.empty(pad)
            self._run(ibuf, fbuf, shape)
        for size in self.copy_sizes:
            self._copy(np.zeros(size, np.int32), np.full(size, self.num_pages, np.int32))
        jax.block_until_ready(self.cache)
        return {"seconds": time.perf_counter() - t0, "compiled": self.compilation_count() - before,
                "shapes": len(self.buckets.all_shapes()) + len(self.copy_sizes)}

    @staticmethod
    def compilation_count() -> int:
        from serving.model_runner import compilation_count

        return compilation_count() + _copy_staged_jit._cache_size()
