"""The model runner for pipeline layouts (`sharding.pipeline.PipelineLayout`).

Same step, same buckets, same host inputs as `ModelRunner`; what differs is
the device state: params are `StagedWeights` (each layer on its stage's
devices) and the KV cache holds, per stage-local layer, one `[p * pages, ...]`
array whose page axis is split over `pipeline`. The block manager is unchanged: page ids are
the same on every stage, each stage holding those pages for its own layers.
The step itself is `model_runner`'s: the layout supplies the forward pass
(the model family's own blocks, `sharding.pipeline.pipeline_forward`), and
everything around it is shared as it is: the logit parts'
device inputs and states (sampling controls' slot state, placed and threaded
like the feed, replicated over the mesh; structured outputs' token bitmask;
custom logits processors), all applied to the logits after the stages, which every
device holds; speculative decoding's verification, in the same step; a draft
model replicated over the whole mesh (`replicated`), so its distributions feed
the step as they are. KV transfer (`serving.disaggregation.kv_transfer`) reads
the layout's `pipeline_parallel_size` and gathers and scatters each stage's
layers in its own block of the page axis, the payload keeping the unstaged
`[layers, ...]` order. A forward part's weight state (LoRA adapter slots) is placed by
the part, which stages it like the layers (`PipelineLayout.stage_lora_slots`),
and the layout's forward adapts each stage's layers with it.
"""

from __future__ import annotations

import jax

from sharding.pipeline import copy_staged_pages
from serving.core.model_runner import ModelRunner


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

    @staticmethod
    def compilation_count() -> int:
        from serving.core.model_runner import compilation_count

        return compilation_count() + _copy_staged_jit._cache_size()
