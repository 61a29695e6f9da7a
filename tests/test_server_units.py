"""The server's pieces without a server: metrics arithmetic and export, chat templates, stream deltas,
and the load generator's statistics."""

import asyncio
import importlib.util
import os
import sys

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model.families import config_by_name, num_params
from model.tokenizer import ByteTokenizer
from serving.api.chat_template import BYTE_CHAT_TEMPLATE, ChatTemplateError, encode_chat, render_chat
from serving.api.answer_stream import DeltaTracker as _DeltaTracker
from serving.api.http_app import completion_logprobs
from serving.api.http_metrics import DevicePeak, ModelCost, ServerMetrics, UtilizationWindow, device_peak
from serving.core.outputs import Logprob
from serving.core.stats import EngineStats, FinishedRequestStats, IterationStats

H100 = DevicePeak("H100 SXM", bandwidth=3.35e12, flops=989e12)


def _serve_bench():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "serve_bench.py")
    spec = importlib.util.spec_from_file_location("serve_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


# --- device peaks and MBU / MFU ----------------------------------------------------------------


def test_device_peak_lookup_and_overrides():
    assert device_peak("NVIDIA H100 80GB HBM3").bandwidth == 3.35e12
    assert device_peak("NVIDIA H100 80GB HBM3").flops == 989e12
    assert device_peak("NVIDIA H200").bandwidth == 4.8e12
    assert device_peak("NVIDIA H100 PCIe").bandwidth == 2.0e12
    assert device_peak("NVIDIA A100-SXM4-80GB").flops == 312e12
    assert device_peak("NVIDIA L4").bandwidth == 300e9
    # Not in the table: no figures rather than a neighbour's (an L40S is not an L4).
    assert device_peak("NVIDIA L40S") is None
    assert device_peak("cpu") is None
    assert device_peak("cpu", bandwidth=20e9) is None
    cpu = device_peak("cpu", bandwidth=20e9, flops=1e12)
    assert (cpu.bandwidth, cpu.flops) == (20e9, 1e12)
    assert device_peak("NVIDIA H200", flops=1.0).bandwidth == 4.8e12


def test_utilization_window_reproduces_the_8b_decode_and_prefill_figures():
    # 8B in bf16, batch-1 decode at 146 tok/s on an H100: MBU 70%, MFU 0.24%.
    cost = ModelCost(weight_bytes=16e9, kv_bytes_per_token=0.0, flops_per_token=2 * 8e9)
    w = UtilizationWindow(cost, H100, window_s=1.0, start=0.0)
    for i in range(1, 147):
        w.add(i / 146, steps=i, tokens=i, kv_tokens_read=0)
    mbu, mfu = w.utilization(now=1.0)
    assert mbu == pytest.approx(146 * 16e9 / 3.35e12)
    assert round(mbu, 2) == 0.70
    assert mfu == pytest.approx(146 * 2 * 8e9 / 989e12)
    # Prefill at 20,000 prompt tokens/s in 10 steps/s: MFU 32%.
    w = UtilizationWindow(cost, H100, window_s=1.0, start=0.0)
    for i in range(1, 11):
        w.add(i / 10, steps=i, tokens=2000 * i, kv_tokens_read=0)
    assert w.utilization(now=1.0)[1] == pytest.approx(0.3236, abs=1e-4)


def test_utilization_window_counts_kv_reads_devices_and_idle_time():
    cost = ModelCost(weight_bytes=1e9, kv_bytes_per_token=1e5, flops_per_token=1e9, num_devices=2)
    peak = DevicePeak("x", bandwidth=1e12, flops=1e14)
    w = UtilizationWindow(cost, peak, window_s=2.0, start=0.0)
    w.add(0.5, steps=1, tokens=8, kv_tokens_read=1000)
    w.add(1.0, steps=2, tokens=16, kv_tokens_read=3000)
    mbu, mfu = w.utilization(now=2.0)
    # Over [0, 2]: 2 steps x 1e9 + 3000 x 1e5 bytes, split over 2 devices.
    assert mbu == pytest.approx((2e9 + 3e8) / 2 / 2.0 / 1e12)
    assert mfu == pytest.approx(16e9 / 2 / 2.0 / 1e14)
    # Later windows only count what happened inside them; an idle window reads 0.
    w.add(3.0, steps=3, tokens=24, kv_tokens_read=3000)
    assert w.utilization(now=4.0)[0] == pytest.approx(1e9 / 2 / 2.0 / 1e12)
    assert w.utilization(now=10.0) == (0.0, 0.0)
    assert UtilizationWindow(cost, None).utilization() is None


def test_model_cost_from_config():
    cfg = config_by_name("llama3-8b")
    cost = ModelCost.from_config(cfg)
    # bf16 weights, untied: the input embedding table is gathered, not streamed.
    embed = cfg.vocab_size * cfg.hidden_size
    assert cost.weight_bytes == pytest.approx(2 * (num_params(cfg) - embed))
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, dim 128, bf16
    assert 2 * 6.9e9 < cost.flops_per_token < 2 * 7.6e9


# --- the Prometheus export ---------------------------------------------------------------------


class _FakeEngine:
    def __init__(self):
        self.listeners = []
        self.snapshot = EngineStats(num_running=2, num_waiting=5, kv_pages_used=30, kv_pages_total=120,
                                    num_preemptions=3, prefix_cache_queried_tokens=400, prefix_cache_hit_tokens=160,
                                    prompt_tokens=900, generation_tokens=77, finished_by_reason={"stop": 4, "abort": 1},
                                    num_steps=12)

    def stats(self):
        return self.snapshot

    def add_stats_listener(self, fn):
        self.listeners.append(fn)


def _samples(metrics: ServerMetrics) -> dict:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            assert s.labels["model_name"] == "m"
            assert s.labels.get("engine") == ("0" if s.name.startswith("vllm:") else None)
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))))] = \
                s.value
    return out


def test_metrics_export_uses_vllm_names_types_and_buckets():
    engine = _FakeEngine()
    cost = ModelCost(weight_bytes=1e6, kv_bytes_per_token=10.0, flops_per_token=2e6)
    metrics = ServerMetrics(engine, "m", cost, DevicePeak("x", 1e9, 1e12), window_s=5.0, max_model_len=300).attach()
    (listener,) = engine.listeners
    listener(IterationStats(step=0, num_tokens=40, num_seqs=3, num_prompt_tokens=38, num_generation_tokens=2,
                            kv_tokens_read=100, host_seconds=0.001, device_seconds=0.01, num_preemptions=0,
                            time_to_first_tokens=[0.02, 0.3], inter_token_latencies=[0.01],
                            finished=[FinishedRequestStats("a", "stop", 1.5, 0.25, 30, 3, prefill_time=0.75,
                                                           decode_time=0.5, inference_time=1.25, n=2,
                                                           max_tokens=16)]))
    s = _samples(metrics)
    assert s[("vllm:num_requests_running", ())] == 2
    assert s[("vllm:num_requests_waiting", ())] == 5
    assert s[("vllm:kv_cache_usage_perc", ())] == 0.25
    assert s[("vllm:num_preemptions_total", ())] == 3
    assert s[("vllm:prefix_cache_queries_total", ())] == 400
    assert s[("vllm:prefix_cache_hits_total", ())] == 160
    assert s[("vllm:prompt_tokens_total", ())] == 900
    assert s[("vllm:generation_tokens_total", ())] == 77
    assert s[("vllm:request_success_total", (("finished_reason", "stop"),))] == 4
    assert s[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "length"),))] == 0
    assert s[("vllm:time_to_first_token_seconds_count", ())] == 2
    assert s[("vllm:time_to_first_token_seconds_bucket", (("le", "0.02"),))] == 1  # vLLM's bucket bounds
    assert s[("vllm:time_to_first_token_seconds_bucket", (("le", "2560.0"),))] == 2
    assert s[("vllm:time_to_first_token_seconds_sum", ())] == pytest.approx(0.32)
    assert s[("vllm:inter_token_latency_seconds_count", ())] == 1
    assert s[("vllm:e2e_request_latency_seconds_sum", ())] == 1.5
    assert s[("vllm:e2e_request_latency_seconds_bucket", (("le", "7680.0"),))] == 1
    assert s[("vllm:request_queue_time_seconds_sum", ())] == 0.25
    assert s[("vllm:request_prefill_time_seconds_sum", ())] == 0.75
    assert s[("vllm:request_decode_time_seconds_sum", ())] == 0.5
    assert s[("vllm:request_inference_time_seconds_sum", ())] == 1.25
    assert s[("vllm:request_time_per_output_token_seconds_sum", ())] == 0.25  # 0.5 s over 2 gaps
    assert s[("vllm:request_params_n_bucket", (("le", "1.0"),))] == 0
    assert s[("vllm:request_params_n_bucket", (("le", "2.0"),))] == 1
    assert s[("vllm:request_params_max_tokens_sum", ())] == 16
    assert s[("vllm:iteration_tokens_total_bucket", (("le", "32.0"),))] == 0
    assert s[("vllm:iteration_tokens_total_bucket", (("le", "64.0"),))] == 1
    assert s[("vllm:iteration_tokens_total_bucket", (("le", "16384.0"),))] == 1
    assert s[("vllm:request_prompt_tokens_sum", ())] == 30
    # 1-2-5 buckets up to the context length (300): ..., 100, 200, then +Inf.
    bounds = [dict(k[1])["le"] for k in s if k[0] == "vllm:request_prompt_tokens_bucket"]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"]
    assert s[("ridgeline:kv_cache_pages_total", ())] == 120
    assert s[("ridgeline:num_steps_total", ())] == 12
    assert s[("ridgeline:model_bandwidth_utilization", ())] > 0
    assert s[("ridgeline:model_flops_utilization", ())] > 0
    assert not any(name.endswith("_created") for name, _ in s)
    # Without peak figures the two gauges are absent, not zero.
    assert ("ridgeline:model_bandwidth_utilization", ()) not in _samples(ServerMetrics(_FakeEngine(), "m", cost))


def test_metric_table_declares_each_name_once_and_types_match_the_scrape():
    from serving.api.http_metrics import METRICS

    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert all(m.name.startswith(("vllm:", "ridgeline:")) for m in METRICS)
    engine = _FakeEngine()
    body, _ = ServerMetrics(engine, "m", ModelCost(1e6, 10.0, 2e6), DevicePeak("x", 1e9, 1e12)).render()
    types = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    for m in METRICS:
        if m.name in types:
            assert types[m.name] == m.kind, m.name


# --- chat templates ----------------------------------------------------------------------------


def test_byte_chat_template_is_the_documented_one():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    text = render_chat(msgs, tok)
    assert text == "<|system|>\nYou are terse.\n<|user|>\nHello\n<|assistant|>\n"
    assert render_chat(msgs, tok, add_generation_prompt=False).endswith("Hello\n")
    assert encode_chat(msgs, tok) == [tok.BOS] + list(text.encode())


class _TemplatedTokenizer(ByteTokenizer):
    bos_token = "<s>"
    eos_token = "</s>"
    chat_template = ("{{ bos_token }}{% for m in messages %}"
                     "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
                     "[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n"
                     "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


def test_a_tokenizers_own_template_is_used_and_can_refuse():
    tok = _TemplatedTokenizer()
    text = render_chat([{"role": "user", "content": "hi"}], tok)
    assert text == "<s>[USER] hi</s>\n[ASSISTANT] "
    # The template wrote BOS as text, so no BOS id is added in front of it.
    assert encode_chat([{"role": "user", "content": "hi"}], tok) == list(text.encode())
    with pytest.raises(ChatTemplateError, match="tool messages"):
        render_chat([{"role": "tool", "content": "x"}], tok)
    assert "BYTE" not in BYTE_CHAT_TEMPLATE


# --- stream deltas and logprob layout ----------------------------------------------------------


def test_delta_tracker_sends_each_character_once_and_holds_incomplete_ones():
    tr = _DeltaTracker()
    assert tr.step("ab", 2, False) == ("ab", 0, 2)
    assert tr.step("ab\ufffd", 3, False) == ("", 2, 3)  # an incomplete character waits
    assert tr.step("abé", 4, False) == ("é", 3, 4)
    assert tr.step("abéc\ufffd", 6, True) == ("c\ufffd", 4, 6)  # at the finish, everything goes
    assert tr.step("abéc\ufffd", 6, True) == ("", 6, 6)


def test_completion_logprobs_layout():
    tok = ByteTokenizer()
    entries = [{104: Logprob(-0.1, 1, "h"), 105: Logprob(-2.5, 2, "i")}, {105: Logprob(-0.3, 1, "i")}]
    lp = completion_logprobs(tok, [104, 105], entries, start_offset=3)
    assert lp.tokens == ["h", "i"]
    assert lp.token_logprobs == [pytest.approx(-0.1), pytest.approx(-0.3)]
    assert lp.top_logprobs[0] == {"h": pytest.approx(-0.1), "i": pytest.approx(-2.5)}
    assert lp.text_offset == [3, 4]
    # Echoed prompts start with no logprob for their first token.
    lp = completion_logprobs(tok, [256, 104], [None, entries[0]])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None


# --- the load generator --------------------------------------------------------------------------


def test_arrivals_are_poisson_at_the_requested_rate():
    sb = _serve_bench()
    gaps = sb.arrival_gaps(20001, rate=4.0, burstiness=1.0, rng=np.random.default_rng(0))
    assert len(gaps) == 20000
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV 1
    bursty = sb.arrival_gaps(20001, rate=4.0, burstiness=0.25, rng=np.random.default_rng(0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)  # gamma shape k: CV 1/sqrt(k)
    assert not sb.arrival_gaps(10, float("inf"), 1.0, np.random.default_rng(0)).any()

    async def indices():
        return [i async for i in sb._arrivals(5, 1e6, 1.0, np.random.default_rng(0))]

    assert asyncio.run(indices()) == [0, 1, 2, 3, 4]


def test_summary_and_goodput():
    sb = _serve_bench()
    rs = []
    for i in range(4):
        r = sb.RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1 * (i + 1), latency=0.1 * (i + 1) + 0.4,
                             itl=[0.1] * 4, start=0.0, chunk_times=[0.1 * k for k in range(5)])
        rs.append(r)
    rs.append(sb.RequestResult(success=False, error="HTTP 500"))
    m = sb.summarize(rs, duration=2.0, slos=sb.parse_goodput(["ttft:250", "tpot:101"]))
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["total_output_tokens"] == 20 and m["total_input_tokens"] == 40
    assert m["output_throughput"] == 10.0
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["request_goodput"] == pytest.approx(1.0)  # the two with TTFT <= 250 ms
    report = sb.format_report(m)
    for line in ("Successful requests:", "Mean TTFT (ms):", "P99 ITL (ms):", "Request goodput (req/s):",
                 "Time per Output Token (excl. 1st token)"):
        assert line in report
    with pytest.raises(ValueError):
        sb.parse_goodput(["latency:5"])


def test_datasets_have_the_requested_lengths():
    sb = _serve_bench()
    lengths = sb._LengthModel(ByteTokenizer())
    reqs = sb.random_dataset(20, 50, 10, 0.5, seed=1, lengths=lengths)
    assert all(25 <= r.prompt_len <= 75 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(len(ByteTokenizer().encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in sb.random_dataset(20, 50, 10, 0.5, 1, lengths)]
    chat = sb.synthetic_chat_dataset(300, 100, 120, 0.9, 1000, 500, seed=2, lengths=sb._LengthModel(None, 4.0))
    ins = np.array([r.prompt_len for r in chat])
    assert 70 < np.median(ins) < 140 and ins.max() > 2 * np.median(ins)  # a log-normal's right tail
    assert all(r.endpoint == "chat" and r.prompt[1]["role"] == "user" for r in chat)
