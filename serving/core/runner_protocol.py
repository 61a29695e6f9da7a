"""What the engine asks of a model runner: one typed contract for every runner.

The engine, the speculative decoder and disaggregated serving talk to the
device only through these methods; none of them reads or assigns a runner's
KV cache, which the runner alone places on its devices (`ModelRunner.place`)
and donates call after call. `ModelRunner` implements it on one device or
under tensor parallelism (one process or several), `PipelineRunner` over
pipeline stages; a capability a runner lacks is reported by its
`*_unsupported()` method as a sentence, which callers turn into a clear
error before anything is queued.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Runner(Protocol):
    cfg: Any  # the model's config
    num_pages: int
    page_size: int
    buckets: Any  # input_batch.Buckets: the step shapes it compiles
    backend: str  # the attention backend
    max_copy_pairs: int  # copy-on-write pairs the one page-copy program takes (more go in several calls)

    # --- steps -----------------------------------------------------------------------------
    def dispatch(self, batch) -> Any:
        """Starts one packed step (`input_batch.StepBatch`); returns a handle whose `result()` waits for
        the sampled ids (`model_runner.StepResult`)."""

    def execute(self, batch) -> Any:
        """Runs one step to completion: `dispatch(batch).result()`."""

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates (src, dst) pages on the device before the step that writes them."""

    def warm_up(self, background: bool = False, quick: bool = False) -> dict:
        """Compiles every step shape (with `background`, the smallest and largest now and the rest in a
        thread; with `quick` too, the smallest compiles quickly now and fully in the thread first);
        {"seconds", "compiled", "shapes", "background"}."""

    def step_shape(self, shape) -> Any:
        """The bucket (`input_batch.StepShape`) a step of `shape` runs in: its own, or while a background
        warm-up is still compiling that, the smallest compiled one that holds it."""

    def warmup_stats(self) -> Any:
        """Where warm-up stands (`step_programs.WarmupStats`)."""

    def stop_warm_up(self) -> None:
        """Ends a background warm-up after the compile under way."""

    def compilation_count(self) -> int:
        """Executables compiled so far for this kind of runner."""

    # --- sampling controls (serving.core.sampling_controls) ------------------------------------
    controls: Any  # the device `ControlState`, or None when the runner keeps none

    def controls_unsupported(self) -> Optional[str]:
        """Why this runner cannot apply logit bias, penalties and the other per-slot controls, or None."""

    def load_controls(self, slot: int, row: tuple) -> None:
        """Writes one control slot's row before the next step reads it."""

    # --- speculative decoding ----------------------------------------------------------------
    def spec_decode_unsupported(self) -> Optional[str]:
        """Why this runner cannot verify drafts, or None."""

    def verify(self, batch, row_fields: np.ndarray, draft_probs) -> Any:
        """Runs one verification step (drafts checked on the device); returns its `StepResult`."""

    def warm_up_verify(self, draft_probs) -> int:
        """Compiles the verification step for every shape; returns how many shapes."""

    @property
    def replicated(self) -> Any:
        """The device or sharding a draft model that feeds `verify` lives on."""

    # --- disaggregated serving -----------------------------------------------------------------
    def kv_transfer_unsupported(self) -> Optional[str]:
        """Why this runner cannot export or import KV pages, or None."""

    def export_pages(self, table: list[int]) -> Any:
        """The pages of `table` gathered on the device, `[layers, 2, P, page_size, kv_heads, head_dim]`."""

    def import_tokens(self, slots: np.ndarray, kv: np.ndarray) -> None:
        """Writes host K/V `[layers, 2, n, kv_heads, head_dim]` at token `slots` of the cache."""

    def warm_up_transfer(self, max_model_len: int) -> int:
        """Compiles the gather and the scatter for every size; returns how many executables compiled."""

    # --- what it holds ---------------------------------------------------------------------------
    @property
    def kv_dtype(self) -> Any:
        """The dtype K and V pages are stored in."""

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameters on the devices."""

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV pool on the devices."""

    def set_dispatch_hook(self, hook) -> None:
        """Multi-host serving: `hook(kind, *host_arrays, **static)` sees every device call first."""
