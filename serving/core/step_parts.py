"""What a feature may add to an engine step, declared once: the `StepPart` interface.

`Engine.step` is four phases: schedule, pack, run, process. The plain engine
needs nothing else; a feature that must act inside a step (speculative
decoding proposes drafts before scheduling and takes the verified tokens
after; shipped prefills are admitted before scheduling; the host KV tier
copies pages out and back in once the step is scheduled) is a part: an object
with these hooks, which the engine calls in order for every part it holds.
A part changes only its own state and what it is handed (the step's packed
batch, the requests it touched), so adding a feature adds a part, not a
branch in the step.

Inputs a part gives the device travel in the packed batch (`StepBatch`), and
so through the one step program (`model_runner._step`). A part whose inputs
are its own pytree (not fields of the packed buffers) declares them with
`step_input_spec`: a fixed shape per step bucket, so nothing recompiles once
the buckets are compiled. The runner then gives the part's arrays
(`step_inputs`, once per step) to its `apply_to_logits` inside the step
program, in the parts' order, before sampling. A part may also keep device
state of its own across steps (`step_state`: sampling controls' per-slot rows
of bias and token counts), which the step reads and updates (`record`). A part
that changes the weights a step computes with (LoRA adapters) keeps a device
state placed as it chooses (`weight_state`: sharded like the weights it adapts)
and applies it before the forward (`apply_to_weights`), reading per-token fields
it adds to the packed step (`token_fields`: each token's adapter slot).

A part may also propose tokens for a decode (`Scheduler.set_proposals`:
speculative decoding's drafts): the decode then runs them after its last
token, one logit row each, the rows' proposals visible to every part
(`StepView.proposals`), and the one part that overrides `sample` draws the
step's ids in the runner's place (verification), reading an array its own
device programs made (`device_input_spec`: the draft model's distributions).

A request reaches the parts through its sampling parameters (`takes_fields`)
and through request arguments beside them (`takes_args`: the adapter it runs
with), which the engine keeps in `Request.part_args` and refuses when no part
takes them; a part lets go of what it holds for a request when the request
leaves (`leave`), however it leaves.

Parts built outside `serving.core` (`serving.features`) reach the engine as
`Engine(parts=...)`: each a part, or a function of the engine that builds one
(or None) once the engine's own pieces (block manager, scheduler, runner)
exist, for parts that plug into them. A part that serves engine options says
which (`serves`, matching `EngineOption.part`): the engine refuses such an
option set without the part, rather than ignore it.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional

import jax
import numpy as np

NO_WARM_UP = {"seconds": 0.0, "compiled": 0, "shapes": 0}


class StepPart:
    """The hooks of one feature; each does nothing unless the feature overrides it."""

    # The fields of `SamplingParams` the part acts on, of those only a part acts on (`sampling_params.
    # part_fields`: extra_args, structured_outputs, ...): a request that sets one on an engine none of
    # whose parts takes it is refused (it would be ignored).
    takes_fields: tuple = ()
    # The request arguments the part reads (`Engine.make_request(part_args=...)`, kept in `Request.part_args`):
    # arguments beside the sampling parameters, such as the LoRA adapter a request runs with. A request
    # giving one that none of the engine's parts takes is refused, naming it (`engine_args.ARG_PARTS`).
    takes_args: tuple = ()
    # The keys of a dict prompt the part reads (`expand_prompt`: "multi_modal_data", images); a prompt giving one
    # that none of the engine's parts takes is refused, naming it (`engine_args.PROMPT_KEY_PARTS`).
    takes_prompt_keys: tuple = ()
    # The `EngineOption.part` of the options this part serves (None: none).
    serves: Optional[str] = None
    # Whether a step the part gave inputs to (`step_inputs` not None) is processed before the next step is
    # scheduled, under overlapped scheduling: the part's next inputs depend on the step's tokens.
    results_before_next_step = False

    def attach(self, engine) -> None:
        """The engine the part serves exists (its tokenizer, EOS ids, scheduler): called once, before any
        request, for parts built before the engine."""

    def gate(self):
        """A `scheduler.AdmissionGate` the part puts on scheduling (None: none)."""
        return None

    def expand_prompt(self, prompt: dict, ids: list, params) -> Optional[tuple]:
        """A dict prompt's entries under the part's `takes_prompt_keys`, placed in the prompt before the
        request is made (`Engine.make_request`, on the caller's thread): (the prompt's ids with the content
        placed in them (image placeholders expanded), the content, which the request keeps as
        `Request.prompt_content`), or None when the prompt brings the part nothing; raises
        `InvalidParameterError` naming the key to refuse it."""
        return None

    def admit(self, request) -> None:
        """Checks a request at admission (`Engine.make_request`, before anything is queued); raises
        `sampling_params.InvalidParameterError` naming the field to refuse it (a 400 over HTTP)."""

    def enqueue(self, request) -> bool:
        """Whether the part takes a new request instead of the scheduler (a shipped prefill, admitted by the
        part); False: the scheduler queues it."""
        return False

    def abort(self, request) -> None:
        """`request` is aborted: the part lets go of whatever it holds of it."""

    def leave(self, request) -> None:
        """`request` left the engine: finished, aborted, or made by `make_request` and dropped before it was
        queued (or refused there by a later part's `admit`). Called once or more per request, for requests
        the part may never have admitted: the part lets go of what it holds for it, once."""

    def before_schedule(self, touched: dict, it) -> None:
        """Runs before the scheduler: requests that produced output go into `touched` ({request id:
        request}), their first tokens' statistics into `it` (the step's `IterationStats`)."""

    def after_schedule(self, out) -> None:
        """Runs once the step is scheduled (`out`: its `SchedulerOutput`), before anything of it (page
        copies, the step itself) is dispatched: the last moment to read pages the step will overwrite."""

    def pack(self, batch) -> None:
        """Adds the part's inputs to the packed step (`input_batch.StepBatch`) before it is dispatched."""

    def new_tokens(self, out, sampled) -> Iterable[tuple]:
        """(sequence, token, logit row) the part takes from a finished step beyond the scheduler's own
        (`Scheduler.update`), each token appended to its sequence just before it is yielded."""
        return ()

    def after_step(self) -> None:
        """Runs once the step's outputs are made."""

    # --- scheduling and sampling that proposals change (speculative decoding) -------------------------
    # Whether the part reads each step's tokens before the next is scheduled (its proposals follow them): the
    # engine then runs its steps one at a time, without overlapped scheduling.
    serial = False
    # Whether the part may take back tokens a step computed (rejected proposals): the block manager then
    # releases no page early behind a sliding window.
    rolls_back = False

    def logit_rows(self, max_num_seqs: int, max_num_batched_tokens: int) -> Optional[int]:
        """The logit rows a step needs when the part gives a decode more than one (its proposals'); None."""
        return None

    def rows_per_decode(self) -> int:
        """The logit rows a decode takes under the part (1 + its proposals), for planning which step buckets
        a call needs."""
        return 1

    def device_input_spec(self) -> Optional[Any]:
        """A `jax.ShapeDtypeStruct` of an array every step takes that the part's own device programs make (the
        draft model's distributions: never through the host, and on a mesh over several processes each
        process's own), set per step as `batch.device_input`; zeros when a step has none. None: no such input."""
        return None

    def sample(self, logits, raw, step: "StepView", views: dict, device_input):
        """Traced into the step program in place of the runner's sampling, by the one part that overrides it:
        (ids [rows] int32, logprobs as `sampler.sample` returns them) from the adjusted `logits`, the model's
        own `raw` ones (what logprobs report), the step's packed fields `views` and the part's device input."""
        raise NotImplementedError

    def holds_steps(self) -> bool:
        """Whether the part holds the engine's steps now (generation paused): `Engine.step` then schedules
        nothing and only finishes the step in flight."""
        return False

    # --- each token a sequence takes (its sampled ones, and those parts bring), for a request some part
    # keeps state of (`Request.part_state`, set at admission) ------------------------------------------
    def replace_token(self, seq, token: int) -> int:
        """The token `seq` takes for its drawn `token` (before it reaches the output): `token` itself, or
        another the part's state of the request forces in its place."""
        return token

    def before_output(self, seq, token: int, result, row: int) -> None:
        """`token` (row `row` of the step's `result`) is about to enter `seq`'s output, before a stop condition
        can finish it and free its pages: the last moment to read them (a prefill's export)."""

    def took_token(self, seq, token: int) -> Optional[str]:
        """`seq` took `token` (now in its output) and has not finished: the reason to finish it with now
        (e.g. "stop"), or None."""
        return None

    # --- per-token fields of the packed step ---------------------------------------------------------
    def token_fields(self) -> tuple:
        """The fields sized by the step's tokens that the part adds to the packed step (`input_batch.TokenField`s:
        a name, a shape with -1 for the tokens, int32 or float32, a fill value); the part writes them in `pack`
        (`batch.views()`) and reads them inside the step (`apply_to_weights`, `apply_to_inputs`)."""
        return ()

    # --- device inputs of the part's own (see the module's docstring) ---------------------------------
    def step_input_spec(self, rows: int) -> Optional[Any]:
        """The part's device inputs of a step with `rows` logit rows: a pytree of `jax.ShapeDtypeStruct`
        (the same for every step of that many rows), or None: the part gives the step program nothing."""
        return None

    def step_inputs(self, batch) -> Any:
        """The part's host arrays for the packed step `batch` (`input_batch.StepBatch`: its rows are
        `batch.sample_rows` then prompt-logprob rows, then padding up to `batch.shape.S`), matching
        `step_input_spec(batch.shape.S)`; only called when that is not None. None: the step takes the
        part's `idle_inputs`, kept on the device, and nothing is transferred."""
        raise NotImplementedError

    def idle_inputs(self, rows: int) -> Any:
        """The inputs of a step the part has nothing for (`step_inputs` None, and warm-up's steps): host
        arrays matching `step_input_spec(rows)` under which `apply_to_logits` changes nothing. Zeros by
        default."""
        return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), self.step_input_spec(rows))

    def apply_to_logits(self, inputs, logits, step: "StepView"):
        """Traced into the step program: `logits` [rows, vocab] float32 -> the same, adjusted by the part's
        `inputs` (placed on the step's devices, replicated over a mesh); `step` is what else the step knows
        of its rows (`StepView`: the sampler's per-row values, drafts, the part's own device state)."""
        return logits

    # --- device state of the part's own, carried from step to step (see `StepView`) -----------------
    def step_state(self) -> Optional[Any]:
        """The initial value of the part's device state (host arrays), or None: none. The runner places it
        like the feed (on the one device, or replicated over the mesh) and threads it through every step,
        donated: each step hands it to `apply_to_logits` (as `step.state`) and takes `record`'s result;
        the part writes it between steps only through `runner.update_part_state` with one of its
        `state_programs`."""
        return None

    def record(self, inputs, state, ids, step: "StepView"):
        """Traced into the step program, after sampling: the part's device state given the ids the rows drew
        (`ids` [rows] int32, -1 for a verified row past its sequence's first rejection)."""
        return state

    def state_programs(self) -> tuple:
        """(jitted, name, example host arguments) of each program that writes the part's state (`jitted(state,
        *host_args) -> state`, donating the state): module-level functions, so another process can run them
        too; the runner compiles each at warm-up by running it once on its example, which must leave the
        state as it was for every use that follows."""
        return ()

    # --- device state that adapts the weights (adapter slots) ----------------------------------------
    def weight_state(self, cfg, params, layout) -> Optional[Any]:
        """The part's device state that the step applies to the weights (placed: the part chooses its
        shardings from the placed `params` of the model `cfg` and the runner's `layout`; called as the
        runner is built, so the part has not been attached yet), or None: the part does not touch
        the weights. Unlike `step_state` it is an input of every step, not threaded through it; the part
        writes it between steps through `runner.update_part_state` with one of its `state_programs`, and
        the result keeps the shardings of the state it replaces."""
        return None

    def apply_to_weights(self, state, views: dict, params, layout) -> tuple:
        """Traced into the step program before the forward: (`params` adapted by the part's `state` and the
        step's packed fields `views` (its `token_fields` among them), keyword arguments for a layout with a
        forward of its own (pipeline stages), which adapts its stages' layers itself)."""
        return params, {}

    def apply_to_inputs(self, views: dict, md) -> tuple:
        """Traced into the step program before the forward: (the batch metadata `md` (`model.cache.
        BatchMetadata`) with what the part's fields of `views` add to it, keyword arguments of the forward
        the part's fields make): an image row's embedding and multimodal positions."""
        return md, {}

    def token_replaced(self, seq) -> None:
        """A part replaced `seq`'s last drawn token (`replace_token`; the sequence has no step in flight): what
        the part's device state recorded of the drawn token is stale."""

    def program_key(self) -> Any:
        """What `apply_to_logits` computes, as part of the step programs' key. The default, the part itself,
        prints with its address, which keeps the steps out of the executable store (`executable_store`); a
        part whose computation a stable text names (its code's digest) returns that text instead."""
        return self

    # --- hidden states a step returns to the part (pooling: embeddings, score heads) ------------------
    def hidden_output(self, hidden, md):
        """Traced into the step program after the forward: a pytree of device arrays the part reads back from
        the step (`read_step`), made from `hidden` [T, embed] (every token row's hidden state after the final
        norm) and the step's batch metadata `md` (`model.cache.BatchMetadata`: the sequences' rows). None (the
        default): the part reads no hidden state, and a step without such parts never computes it."""
        return None

    def read_step(self, batch, result) -> None:
        """A finished step, before its tokens are taken (`batch`: the packed `input_batch.StepBatch`; `result`:
        its `StepResult`, whose `hidden_outputs[i]` is what the part's `hidden_output` made, still on the
        device until the part reads it)."""

    # --- what the engine reports -------------------------------------------------------------------
    def engine_stats(self) -> dict:
        """Fields of `EngineStats` the part fills (a snapshot; the engine's `stats()` may run on any thread)."""
        return {}

    def describe(self) -> dict:
        """Entries the part adds to `Engine.describe()` (what is loaded, for logs and sizing)."""
        return {}

    def reset_prefix_cache(self) -> None:
        """The engine forgets its cached prefix pages: the part forgets what it caches of them."""

    def weights_replaced(self) -> None:
        """The engine's weights were replaced (`serving.features.weight_updates`): the part forgets what it cached of what
        the old ones computed (an image encoder's outputs)."""

    def warm_up(self) -> dict:
        """Compiles what the part runs on the device itself; {"seconds", "compiled", "shapes"}."""
        return dict(NO_WARM_UP)


class Proposals(NamedTuple):
    """The proposed tokens a step's rows follow (a part's proposals for a decode, `Scheduler.set_proposals`:
    speculative decoding's drafts), as the step reads them.

    A decode with k proposals has k + 1 consecutive rows; row j predicts the token after proposals 0..j-1,
    so a part that depends on the output so far sees those proposals as output tokens already, exactly as
    the plain step would when it drew them one at a time."""

    token: Any  # [R] i32: the proposal the row checks (-1: none; the last row of a group has none)
    group_start: Any  # [R] i32: the first row of the row's sequence (a row on its own: itself)


class StepView(NamedTuple):
    """What the step program gives a part's `apply_to_logits` and `record` beside its own inputs."""

    token_index: Any  # [R] i32: the output position the row draws (tokens drawn before it, proposals included)
    sampling: Any  # the sampler's per-row values (`sampler.SamplingInputs`: penalties, min_tokens, ...)
    proposals: Optional[Proposals]  # what the rows follow; None for an engine whose steps take no proposals
    state: Any = None  # the part's device state (`StepPart.step_state`), None for a part without one


def sampler_part(parts):
    """The one built part among `parts` that samples instead of the runner (`StepPart.sample`), or None."""
    found = [p for p in parts if isinstance(p, StepPart) and type(p).sample is not StepPart.sample]
    if len(found) > 1:
        raise ValueError(f"two parts sample instead of the runner: {[type(p).__name__ for p in found]}")
    return found[0] if found else None


def logit_parts(parts) -> tuple:
    """The built parts among `parts` that give the step program device inputs of their own, in order."""
    return tuple(p for p in parts if isinstance(p, StepPart) and p.step_input_spec(1) is not None)


def forward_parts(parts) -> tuple:
    """The built parts among `parts` that act before the forward inside the step, in order: those overriding
    `weight_state`, `apply_to_weights` or `apply_to_inputs`."""
    hooks = ("weight_state", "apply_to_weights", "apply_to_inputs")
    return tuple(p for p in parts if isinstance(p, StepPart)
                 and any(getattr(type(p), hook) is not getattr(StepPart, hook) for hook in hooks))


def hidden_parts(parts) -> tuple:
    """The built parts among `parts` that read hidden states back from the step (`StepPart.hidden_output`)."""
    return tuple(p for p in parts if isinstance(p, StepPart) and type(p).hidden_output is not StepPart.hidden_output)


def token_fields(parts) -> tuple:
    """Every built part's fields of the packed step (`StepPart.token_fields`), in order."""
    return tuple(field for p in parts if isinstance(p, StepPart) for field in p.token_fields())


def check_applied(parts, applied) -> None:
    """Refuses a part with device inputs or weight state of its own that the runner does not apply
    (`applied`: its `logit_parts`, `forward_parts` and `hidden_parts`): one built from the engine, after the runner, or given
    to an engine over a runner built elsewhere. Its step would leave the part out."""
    sampler = sampler_part(parts)
    missing = [p for p in logit_parts(parts) + forward_parts(parts) + hidden_parts(parts) + ((sampler,) if sampler else ())
               if p not in applied]
    if missing:
        raise ValueError(f"{type(missing[0]).__name__}: a part with device inputs of its own must be given "
                         "built (not as a function of the engine) to an engine that builds its runner")


# --- the logit parts' inputs as the runner passes them (a tuple, one pytree per part) --------------------
def input_specs(parts, rows: int, sharding) -> tuple:
    """Each part's input spec for a step of `rows` logit rows, placed with `sharding` (the host inputs')."""
    return tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                              part.step_input_spec(rows)) for part in parts)


def inputs_from_leaves(parts, rows: int, leaves, idle=()) -> tuple:
    """The parts' inputs rebuilt from their leaves in order (a step another process announced); the
    parts at the indices `idle` gave none (None in the result: their idle inputs)."""
    given = [i for i in range(len(parts)) if i not in idle]
    tree = jax.tree.structure(tuple(parts[i].step_input_spec(rows) for i in given))
    inputs = dict(zip(given, jax.tree.unflatten(tree, list(leaves))))
    return tuple(inputs.get(i) for i in range(len(parts)))


# --- programs that write parts' device states, counted with the runner's compilations -----------------
_STATE_PROGRAMS: list = []


def state_program(jitted):
    """Registers a module-level jitted program of a part's `state_programs`, so that the runner's
    `compilation_count` (which tests of "nothing recompiles after warm-up" read) includes it; returns it."""
    _STATE_PROGRAMS.append(jitted)
    return jitted


def state_programs_compiled() -> int:
    """Executables compiled so far for the registered state programs (`state_program`)."""
    return sum(jitted._cache_size() for jitted in _STATE_PROGRAMS)
