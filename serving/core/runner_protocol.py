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

    # --- programs of other packages over the cache (KV transfer) ---------------------------------
    def run_on_cache(self, jitted, *host_arrays, donate: bool, **static) -> Any:
        """Runs `jitted(cache, *placed host arrays, **static)`; with `donate` the program returns
        `(new cache, outputs)`, the runner keeps the cache (in its shardings, passed as the static
        `cache_shardings`) and returns `outputs`. A runner whose cache such programs cannot read (pipeline
        stages) also has `kv_transfer_unsupported()`, a sentence (see `serving.disaggregation.kv_transfer`)."""

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
