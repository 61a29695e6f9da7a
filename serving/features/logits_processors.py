"""Custom logits processors: classes written outside the project, run inside the step program.

A processor is any importable class (named `module:Class`, option
`logits_processors`) with three methods:

    class BanToken:
        def __init__(self, config):          # a ProcessorConfig: vocab_size, max_num_seqs, dtype
            ...
        def rows(self, samples):             # host side, once per step: one Sample per logit row
            return {"ban": np.array(...)}    # a pytree of arrays, each with a leading [len(samples)] axis
        def apply(self, rows, logits):       # traced into the step: logits [S, vocab] float32 -> the same
            ...

and optionally `validate(extra_args)`, which refuses a request (raise ValueError) at admission.

Why on the device: the logits never leave it (vLLM V1's processors run on the
GPU too), and a processor's work is then one more fused op in the step. Why a
host `rows` and a traced `apply`: a request switches a processor through its
`extra_args` (`SamplingParams.extra_args`; `vllm_xargs` or `extra_args` over
HTTP), and the step program cannot read a dict; `rows` turns the step's
samples into arrays of a fixed shape per step bucket, so the program compiles
once per bucket with the processor inside it and never again.

The rows passed to `rows` are the step's logit rows in order: each sampling
row (a speculative decode's k + 1 verifying rows each see the drafts before
them, `Sample.draft_token_ids`), then padding (`Sample.request_id` None,
empty `extra_args`; prompt-logprob rows are padding too: their logprobs are
the model's own). Processors are applied after the structured-output mask and
the sampling controls (logit bias, penalties), in the order given, and the
reported logprobs stay the model's (as vLLM's). Each processor is checked when
the engine is built: `rows` on padding samples for two row counts, and `apply`
traced on them, must give arrays with the leading axis and logits of the
input's shape, or the engine (and the server) refuses to start, naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import types
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from serving.core.sampling_params import InvalidParameterError
from serving.core.step_parts import StepPart

_NO_ARGS = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class ProcessorConfig:
    """What a processor's constructor is given."""

    vocab_size: int  # the logits' last axis
    max_num_seqs: int  # the most sequences in one step (a step may have more rows: speculative verification)
    dtype: str = "float32"  # the logits' dtype inside the step (whatever the model computes in)


class Sample:
    """One logit row of a step, as a processor's `rows` sees it."""

    __slots__ = ("request_id", "extra_args", "sample_index", "token_index", "draft_token_ids", "_seq")

    def __init__(self, seq, extra_args, sample_index: int = 0, token_index: int = 0, draft_token_ids=()):
        self._seq = seq
        self.request_id = None if seq is None else seq.request.request_id  # None: a padding row
        self.extra_args = extra_args  # the request's `extra_args` ({} when it gave none)
        self.sample_index = sample_index  # which of the request's n samples
        # The index in the output of the token this row draws. With overlapped scheduling the host may not
        # have the token before it yet: `output_token_ids` holds the tokens it has.
        self.token_index = token_index
        self.draft_token_ids = tuple(draft_token_ids)  # speculative drafts this row follows, verified before it

    @property
    def is_padding(self) -> bool:
        return self._seq is None

    @property
    def prompt_token_ids(self) -> list:
        return [] if self._seq is None else self._seq.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list:
        """The sample's output tokens the host has (a copy, made when asked for)."""
        return [] if self._seq is None else self._seq.output_token_ids


PADDING = Sample(None, _NO_ARGS)


def load_class(spec: str):
    """The class `spec` ("package.module:Class") names."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"expected 'module:Class', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r}: {e}") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"module {module_name!r} has no class {name!r}")
    for method in ("rows", "apply"):
        if not callable(getattr(cls, method, None)):
            raise ValueError(f"{name} has no method {method}(...)")
    return cls


def parse_specs(value) -> list[str]:
    """The processor names of the option: a comma-separated string or a sequence of strings."""
    if isinstance(value, str):
        specs = [s.strip() for s in value.split(",")]
    elif isinstance(value, (list, tuple)):
        specs = [s.strip() if isinstance(s, str) else s for s in value]
    else:
        raise ValueError(f"logits_processors: expected 'module:Class[,module:Class]' or a list of them, got {value!r}")
    if not specs or not all(isinstance(s, str) and s for s in specs):
        raise ValueError(f"logits_processors: expected 'module:Class[,module:Class]', got {value!r}")
    return specs


def _source_digest(cls) -> Optional[str]:
    """A digest of the file defining `cls` (None when it has none): a processor's code names its programs."""
    try:
        with open(inspect.getsourcefile(cls), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError):
        return None


class _Processor:
    """One loaded processor, checked: its name, instance and per-row input shapes."""

    def __init__(self, spec: str, config: ProcessorConfig):
        self.spec = spec
        cls = load_class(spec)
        self.instance = cls(config)
        self.digest = _source_digest(cls)
        self.validate = getattr(self.instance, "validate", None)
        one = self._host_rows([PADDING])
        self.leaf_shapes = [(x.shape[1:], x.dtype) for x in jax.tree.leaves(one)]
        self.tree = jax.tree.structure(one)
        self._check_apply(config, rows=3)

    def _host_rows(self, samples: list) -> Any:
        """The processor's `rows`, checked: a pytree of numpy arrays with a leading axis of len(samples)."""
        tree = self.instance.rows(samples)
        leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
        for x in leaves:
            if x.ndim == 0 or x.shape[0] != len(samples):
                raise ValueError(f"rows() returned an array of shape {x.shape} for {len(samples)} samples "
                                 f"(each array's leading axis must be the samples)")
            if x.dtype == object:
                raise ValueError("rows() returned an array of Python objects")
        return jax.tree.unflatten(jax.tree.structure(tree), leaves)

    def input_spec(self, rows: int) -> Any:
        return jax.tree.unflatten(self.tree, [jax.ShapeDtypeStruct((rows,) + shape, dtype)
                                              for shape, dtype in self.leaf_shapes])

    def rows_for(self, samples: list) -> Any:
        """This step's rows, with the shapes and dtypes the step program was compiled for."""
        tree = self._host_rows(samples)
        got = [(x.shape[1:], x.dtype) for x in jax.tree.leaves(tree)]
        if jax.tree.structure(tree) != self.tree or got != self.leaf_shapes:
            raise ValueError(f"logits processor {self.spec}: rows() changed its structure or dtypes "
                             f"({got} after {self.leaf_shapes})")
        return tree

    def _check_apply(self, config: ProcessorConfig, rows: int) -> None:
        self.rows_for([PADDING] * rows)  # the same structure for another row count
        logits = jax.ShapeDtypeStruct((rows, config.vocab_size), jnp.dtype(config.dtype))
        out = jax.eval_shape(self.instance.apply, self.input_spec(rows), logits)
        if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != logits.shape:
            shape = getattr(out, "shape", type(out).__name__)
            raise ValueError(f"apply() returned {shape} for logits of shape {logits.shape}")


class LogitsProcessors(StepPart):
    """The engine's custom logits processors, as one step part with device inputs of its own."""

    takes_fields = ("extra_args",)

    def __init__(self, specs, config: ProcessorConfig):
        """Loads and checks each processor; a ValueError names the first one that fails."""
        self.processors = []
        for spec in parse_specs(specs):
            try:
                self.processors.append(_Processor(spec, config))
            except Exception as e:  # a user's class may raise anything: refuse to start, naming it
                raise ValueError(f"logits processor {spec}: {type(e).__name__}: {e}") from e

    def admit(self, request) -> None:
        args = request.params.extra_args or {}
        for p in self.processors:
            if p.validate is not None:
                try:
                    p.validate(args)
                except (TypeError, ValueError) as e:
                    raise InvalidParameterError("extra_args", f"extra_args: {p.spec}: {e}") from None

    def step_input_spec(self, rows: int):
        return tuple(p.input_spec(rows) for p in self.processors)

    def step_inputs(self, batch):
        samples = step_samples(batch)
        return tuple(p.rows_for(samples) for p in self.processors)

    def apply_to_logits(self, inputs, logits, step):
        for p, rows in zip(self.processors, inputs, strict=True):
            logits = p.instance.apply(rows, logits).astype(logits.dtype)
        return logits

    def program_key(self):
        if any(p.digest is None for p in self.processors):
            return self  # unnamed code: its steps are never stored
        return ("logits_processors",) + tuple((p.spec, p.digest) for p in self.processors)


def step_samples(batch) -> list:
    """One `Sample` per logit row of the packed step (`input_batch.StepBatch`), padding included."""
    token_index = batch.shape.split(batch.ibuf, batch.fbuf)["token_index"]
    drafts = {}  # row -> the drafts before it (a speculative group's rows)
    for first, _, _, group in batch.proposal_groups:
        for j in range(len(group) + 1):
            drafts[first + j] = group[:j]
    samples = []
    for row, (seq, sample_index) in enumerate(batch.sample_rows):
        req = seq.request
        samples.append(Sample(seq, req.params.extra_args or _NO_ARGS, sample_index, int(token_index[row]),
                              drafts.get(row, ())))
    samples.extend([PADDING] * (batch.shape.S - len(samples)))
    return samples
