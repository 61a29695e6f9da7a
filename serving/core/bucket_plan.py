"""Which step buckets a batch of requests will reach, and which larger bucket may run a step in their place.

`LLM`'s default warm-up (`StepPrograms.start_as_needed`) compiles nothing before the first
`generate`; that call knows its prompts and output lengths, so it asks for the few buckets its
steps will run in (`expected_shapes`) and every other step pads into one of those, as long as the
padding is cheap (`holds_cheaply`). The mixed workload of `benchmarks/first_generate.py` (32
requests, prompts and outputs of 16-256 tokens, `LLM`'s default limits) reaches 9 buckets when
each compiles its own (two prefill page buckets; decodes of 32, 24, 16, 8, 4, 2 and 1 rows); it
expects 2 (the full prefill chunk at the longest context's pages, and the decode of all 32
requests), which hold all 9 cheaply: a decode of 17-24 rows then runs in the 32-row bucket
rather than compiling its own. The finer decode buckets (`Buckets.token_sizes`) are used where
every bucket is compiled up front for many calls (a full or background warm-up: the server) or
where a step compiles its own bucket (`warmup=False`).

Pure functions of the bucket set and the requests' lengths: no engine state.
"""

from __future__ import annotations

from typing import Iterable

from serving.core.input_batch import Buckets, StepShape

# Steps of at most this many tokens are decode-sized: their time is the read of every weight, which
# does not depend on how many rows multiply it, so running one in a bucket of up to this many tokens
# costs little more than running it in its own (on XLA CPU and on GPUs alike; on a GPU the row count
# at which a step stops being memory-bound is higher still).
PAD_FREE_TOKENS = 32


def holds_cheaply(holder: StepShape, shape: StepShape, buckets: Buckets) -> bool:
    """Whether a step of `shape` may run in the compiled bucket `holder` instead of compiling its own:
    `holder` is at least as large in every dimension, at most twice the tokens (or decode-sized, up to
    `PAD_FREE_TOKENS`) and at most twice the pages (or a bucket whose attention visits only each row's
    live pages whatever the page count, `Buckets.one_page_bucket`). Padding a 16-token decode into a
    512-token prefill program would cost more per step than a compile saves over a run."""
    if holder.T < shape.T or holder.S < shape.S or holder.P < shape.P or holder.token_fields != shape.token_fields:
        return False
    tokens_ok = holder.T <= max(2 * shape.T, PAD_FREE_TOKENS)
    pages_ok = holder.P <= 2 * shape.P or buckets.one_page_bucket(holder.T)
    return tokens_ok and pages_ok


def _pages(tokens: int, page_size: int) -> int:
    return max(1, -(-tokens // page_size))


def expected_shapes(buckets: Buckets, page_size: int, requests: Iterable[tuple[int, int, int]],
                    rows_per_seq: int = 1) -> list[StepShape]:
    """The buckets the steps of `requests` ((prompt tokens, new tokens at most, sequences) each, all
    arriving together) will mostly run in, in the order the steps reach them: the prefill (as many of
    the prompts' tokens as fit one step, at the page bucket of the longest context the run reaches when
    that holds the prompts' own cheaply, so the mixed steps late in the prefill fit too) and the decode
    of every sequence at once (`rows_per_seq` token rows each: 1 + the drafts a speculative decode
    verifies per step). A step outside them pads into one of them when `holds_cheaply` allows,
    and otherwise compiles its own bucket. Empty for no requests."""
    requests = list(requests)
    if not requests:
        return []
    prompt_tokens = sum(p for p, _, _ in requests)
    longest_prompt = max(p for p, _, _ in requests)
    longest_context = max(p + n for p, n, _ in requests)
    max_pages = buckets.page_sizes[-1]
    prompt_pages = buckets.pages_for(min(_pages(longest_prompt, page_size), max_pages))
    context_pages = buckets.pages_for(min(_pages(longest_context, page_size), max_pages))
    T = buckets.tokens_for(min(prompt_tokens, buckets.max_num_batched_tokens))
    P = buckets.step_pages(T, context_pages if context_pages <= 2 * prompt_pages else prompt_pages)
    shapes = [buckets.step_shape(T, buckets.seqs_for(T), P)]
    if any(n > 1 for _, n, _ in requests):  # something decodes
        seqs = min(sum(s for _, _, s in requests), buckets.max_num_seqs)
        T = buckets.tokens_for(min(seqs * rows_per_seq, buckets.max_num_batched_tokens))
        shapes.append(buckets.step_shape(T, buckets.seqs_for(T), buckets.step_pages(T, context_pages)))
    return list(dict.fromkeys(shapes))
