"""The public APIs: AsyncEngine streaming and aborts, bad input, and the embedded default model."""

import asyncio
import os

import jax
import pytest

from model.params import init_params
from model.tokenizer import ByteTokenizer
from serving import AsyncEngine, InvalidParameterError, LLM, SamplingParams
from serving.llm import default_checkpoint_dir
from test_engine import CFG, make_llm


@pytest.fixture(scope="module")
def llm():
    return make_llm(init_params(CFG, jax.random.key(42)))


def test_async_streams_cumulative_outputs_equal_to_generate(llm):
    prompts = [[1] + list(range(3, 3 + k)) for k in (5, 17, 30)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    engine = AsyncEngine(llm.engine)

    async def collect(i):
        seen = []
        async for out in engine.generate(prompts[i], sp, f"s{i}"):
            seen.append(list(out.outputs[0].token_ids))
        return seen, out

    async def main():
        return await asyncio.gather(*(collect(i) for i in range(3)))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for (seen, final), w in zip(results, want):
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert seen[-1] == w
        assert all(a == seen[-1][:len(a)] for a in seen)  # each output extends the previous one
        assert len(seen) > 1  # it streamed


def test_async_cancel_frees_pages_and_bad_input_is_rejected_first(llm):
    engine = AsyncEngine(llm.engine)

    async def main():
        with pytest.raises(InvalidParameterError) as e:
            async for _ in engine.generate([1, 2, 3], SamplingParams(top_p=0.0), "bad"):
                pass
        assert e.value.param == "top_p"
        streams = [engine.generate([1] + list(range(3, 40)), SamplingParams(max_tokens=24, ignore_eos=True), f"c{i}")
                   for i in range(3)]
        for s in streams:
            await s.__anext__()  # each is admitted and holds pages
        assert engine.stats().kv_pages_used > 0
        for s in streams:
            await s.aclose()  # what a client disconnect does
        for _ in range(200):
            s = engine.stats()
            if (s.num_running, s.num_waiting, s.kv_pages_used) == (0, 0, 0):
                break
            await asyncio.sleep(0.01)
        # A later good request still succeeds.
        last = None
        async for last in engine.generate([1, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True), "ok"):
            pass
        return s, last

    try:
        s, last = asyncio.run(main())
    finally:
        engine.shutdown()
    assert (s.num_running, s.num_waiting, s.kv_pages_used) == (0, 0, 0)
    assert s.finished_by_reason.get("abort", 0) >= 3
    assert last.finished and len(last.outputs[0].token_ids) == 3


def test_generate_validates_everything_before_running_anything(llm):
    before = llm.engine.stats().num_steps
    with pytest.raises(InvalidParameterError) as e:
        llm.generate([[1, 2, 3], [1, 2, 3]], [SamplingParams(max_tokens=2), SamplingParams(temperature=-1)])
    assert e.value.param == "temperature"
    with pytest.raises(InvalidParameterError) as e:
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    assert e.value.param == "max_tokens" and "64" in str(e.value)
    with pytest.raises(InvalidParameterError) as e:
        llm.generate([[1, 500]])
    assert e.value.param == "prompt"
    assert llm.engine.stats().num_steps == before and not llm.engine.has_unfinished_requests()


def test_tensor_parallel_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=0)


def test_embedded_default_model_text_and_stop_strings():
    """`LLM()` serves the byte-level model shipped in model/default."""
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, min_token_bucket=8)
    assert llm.checkpoint == default_checkpoint_dir() and os.path.isdir(llm.checkpoint)
    assert isinstance(llm.tokenizer, ByteTokenizer)
    prompt = "def add(a, b):\n    "
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out = llm.generate(prompt, sp)[0]
    c = out.outputs[0]
    assert out.prompt == prompt and out.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert c.finish_reason == "length" and len(c.token_ids) == 48
    assert c.text == llm.tokenizer.decode(c.token_ids) and len(c.text) >= 8
    # Stop at a string the model really produces: the text ends just before it.
    stop = c.text[5:8]
    at = c.text.index(stop)
    s = llm.generate(prompt, sp.clone(stop=[stop]))[0].outputs[0]
    assert (s.finish_reason, s.stop_reason, s.text) == ("stop", stop, c.text[:at])
    kept = llm.generate(prompt, sp.clone(stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == c.text[:at + len(stop)]
    # Multi-byte prompt text round-trips through the byte tokenizer.
    u = llm.generate("# café — ünïcode ✓\n", SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert u.prompt_token_ids[1:] == list("# café — ünïcode ✓\n".encode("utf-8"))
    assert u.outputs[0].text == llm.tokenizer.decode(u.outputs[0].token_ids)
