"""`sharding.plan` against arithmetic worked by hand for the Llama-3 8B and 70B shapes on an H100 SXM.

Every expected number below is derived in the test from the model shapes, written out as
literals (not read from the code under test), and where the performance chapter in the
references quotes a figure for the same case the test checks against it too.
H100 SXM: 80e9 B HBM at 3.35e12 B/s, 989e12 dense BF16 FLOP/s, NVLink 900e9 B/s, PCIe 64e9 B/s;
collective latency floors 5 us (NVLink) and 25 us (PCIe); runtime reserve 4e9 B; bf16 = 2 B.
"""

import json
import math

import pytest

from model.families import config_by_name
from sharding.estimate import PlanInputs, plan
from sharding.hardware import get_gpu
from sharding.plan import main

H100 = get_gpu("h100-sxm")
HBM, BW, PEAK, RESERVE = 80e9, 3.35e12, 989e12, 4e9

# Llama-3 8B: vocab 128256, hidden 4096, ffw 14336, 32 layers, 32 q heads, 8 KV heads, head_dim 128, untied.
E8 = 128256 * 4096  # embedding table = 525,336,576 params (lm_head the same)
LAYER8 = 4096 * 128 * (32 + 8 + 8 + 32) + 3 * 4096 * 14336 + 2 * 4096  # attn + mlp + 2 norms
P8 = 2 * E8 + 32 * LAYER8 + 4096
# Llama-3 70B: vocab 128256, hidden 8192, ffw 28672, 80 layers, 64 q heads, 8 KV heads, head_dim 128.
E70 = 128256 * 8192
LAYER70 = 8192 * 128 * (64 + 8 + 8 + 64) + 3 * 8192 * 28672 + 2 * 8192
P70 = 2 * E70 + 80 * LAYER70 + 8192
NORMS70 = 80 * 2 * 8192 + 8192  # replicated under TP


def run(model, **kw):
    return plan(PlanInputs(config_by_name(model), H100, model_name=model, **kw))


def test_hand_totals_are_the_published_sizes():
    assert LAYER8 == 218_112_000 and P8 == 8_030_261_248  # "8B"
    assert LAYER70 == 855_654_400 and P70 == 70_553_706_496  # "70B"


def test_llama3_8b_kv_and_concurrency_at_8k():
    r = run("llama3-8b", context_len=8000)
    mem = r["memory"]
    assert r["model"]["params"] == P8
    assert mem["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131072  # chapter: 131,072 B
    assert mem["kv_bytes_per_sequence"] == 131072 * 8000 == 1_048_576_000  # chapter: 1.05 GB
    assert mem["weight_bytes_per_device"] == P8 * 2 == 16_060_522_496
    free = HBM - RESERVE - P8 * 2
    assert mem["kv_free_bytes_per_device"] == pytest.approx(free) and free == pytest.approx(59.94e9, rel=1e-3)
    assert mem["max_concurrent_sequences"] == math.floor(free / 1_048_576_000) == 57  # chapter: 57
    assert run("llama3-8b", context_len=8192)["memory"]["max_concurrent_sequences"] == 55  # 59.94e9 / 1.0737e9
    assert r["fits"] and r["problems"] == []


def test_llama3_8b_decode_and_prefill_on_the_roofline():
    r = run("llama3-8b", context_len=8000, prompt_len=2048)
    assert r["roofline"]["ridge_point"] == pytest.approx(989 / 3.35) == pytest.approx(295.2, abs=0.05)
    # Decode, batch 1: every weight except the embedding table (a lookup), plus one 8000-token KV.
    step_bytes = P8 * 2 - E8 * 2 + 131072 * 8000
    assert r["decode"]["bytes_per_device"] == step_bytes == 16_058_425_344
    assert r["decode"]["step_time_s"] == pytest.approx(step_bytes / BW, rel=1e-12)
    assert r["decode"]["step_time_s"] == pytest.approx(4.79e-3, rel=2e-3)  # 16 GB / 3.35 TB/s
    assert r["decode"]["tokens_per_s"] == pytest.approx(209, rel=5e-3)  # chapter: 209 tok/s
    assert r["decode"]["bound"] == "memory"
    # Prefill of 2048 tokens at 50% MFU: 2 FLOPs per matmul parameter per token + causal attention.
    mm = P8 - E8
    attn = 4 * 32 * 128 * 32 * (2048 * 2049 // 2)  # QK^T and PV, per head, per layer, per visible pair
    flops = 2 * mm * 2048 + attn
    assert r["prefill"]["flops_per_device"] == flops
    assert r["prefill"]["time_s"] == pytest.approx(flops / (PEAK * 0.5), rel=1e-12)  # 64.4 ms
    assert r["prefill"]["time_s"] == pytest.approx(66e-3, rel=0.05)  # chapter: 66 ms at 8e9 flat params
    assert r["prefill"]["bound"] == "compute"


def test_llama3_8b_intensity_at_batch_64_short_chats():
    # Chapter: B=64 chats of 600 live tokens reach an intensity of ~49, not 64.
    r = run("llama3-8b", context_len=600, batch=64)
    flops = 2 * (P8 - E8) * 64 + 4 * 32 * 128 * 32 * 600 * 64
    byts = (P8 - E8) * 2 + 64 * 600 * 131072
    assert r["decode"]["intensity"] == pytest.approx(flops / byts, rel=1e-12)
    assert r["decode"]["intensity"] == pytest.approx(49, rel=0.02)


def test_llama3_70b_needs_tp_and_fits_at_tp4():
    r1 = run("llama3-70b", context_len=8000)
    assert not r1["fits"]
    assert "weights need 141.11 GB per device" in r1["problems"][0]  # chapter: 140 GB vs 80 GB
    r = run("llama3-70b", tp=4, context_len=8000)
    mem = r["memory"]
    w_dev = ((P70 - NORMS70) // 4 + NORMS70) * 2  # everything but the norms splits 4 ways
    assert mem["weight_bytes_per_device"] == w_dev == 35_278_831_616  # chapter: 35 GB
    assert mem["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680  # chapter: 320 KB
    assert mem["kv_bytes_per_token_per_device"] == 327_680 / 4  # 2 of 8 KV heads per GPU
    assert r["layout"]["kv_heads_per_device"] == 2
    free = HBM - RESERVE - w_dev  # 40.72 GB (chapter: 41 GB)
    assert mem["max_concurrent_sequences"] == math.floor(free / (327_680 * 8000 / 4)) == 62  # chapter: ~62
    assert r["fits"]


def test_llama3_70b_tp4_decode_latency_and_collectives():
    r = run("llama3-70b", tp=4, context_len=1000)
    collective = 5e-6 + 2 * 3 / 4 * 8192 * 2 / 900e9  # latency floor + ring traffic of one 16 KB vector
    comm = (2 * 80 + 1) * collective  # 2 per layer + the vocab-parallel embedding
    mem_bytes = ((P70 - NORMS70) // 4 + NORMS70) * 2 - E70 * 2 // 4 + 81_920 * 1000
    assert r["collectives"]["all_reduces_per_layer"] == 2 and r["collectives"]["all_reduces_per_step"] == 161
    assert r["decode"]["comm_time_s"] == pytest.approx(comm, rel=1e-12)
    assert r["decode"]["step_time_s"] == pytest.approx(mem_bytes / BW + comm, rel=1e-12)
    assert r["decode"]["step_time_s"] == pytest.approx(11.2e-3, rel=0.02)  # chapter: ~11.2 ms
    assert r["decode"]["tokens_per_s"] == pytest.approx(90, rel=0.02)  # chapter: ~90 tok/s
    nv, pcie = r["collectives"]["decode_step"]["nvlink"], r["collectives"]["decode_step"]["pcie"]
    assert nv["bytes_per_gpu"] == 161 * 24_576  # chapter: 160 x 24 KB ~ 3.8 MB
    assert nv["latency_floor_s"] == pytest.approx(161 * 5e-6)  # chapter: ~0.8 ms
    assert pcie["time_s"] == pytest.approx(161 * (25e-6 + 24_576 / 64e9))  # chapter: ~4 ms
    assert pcie["time_s"] == pytest.approx(4e-3, rel=0.05)


def test_405b_needs_two_nodes_and_pipeline_bubble():
    assert not run("llama3-405b", tp=8)["fits"]  # chapter: 101 GB per GPU does not fit in 80
    assert run("llama3-405b", tp=8)["memory"]["weight_bytes_per_device"] == pytest.approx(101e9, rel=0.01)
    r = run("llama3-405b", tp=8, pp=2, microbatches=1)
    assert r["fits"] and r["memory"]["weight_bytes_per_device"] == pytest.approx(51e9, rel=0.01)  # chapter: ~51
    assert r["layout"]["layers_per_stage"] == [63, 63]
    bubble = lambda p, m: run("llama3-8b", pp=p, microbatches=m, batch=64)["pipeline"]["bubble_fraction"]
    assert bubble(4, 16) == pytest.approx(3 / 19) and bubble(4, 64) == pytest.approx(3 / 67)  # 15.8%, 4.5%
    assert bubble(1, 1) == 0


def test_what_does_not_fit_says_why():
    r = run("llama3-8b", context_len=8000, batch=64)
    assert not r["fits"] and r["problems"] == ["batch 64 exceeds the 57 sequences of 8000 tokens whose KV fits"]
    r = run("llama3-8b", tp=3)
    assert not r["fits"] and "'q_heads', size 32) does not divide" in r["problems"][0]
    r = plan(PlanInputs(config_by_name("llama3-8b"), get_gpu("l4"), context_len=131072))
    assert not r["fits"] and r["problems"][0].startswith("no room for one sequence of 131072 tokens")
    assert r["collectives"]["decode_step"]["nvlink"] is None  # the L4 has no NVLink


def test_kv_heads_beyond_tp_are_replicated_in_the_plan():
    r = run("llama3-8b", tp=16)
    assert r["layout"]["kv_heads_per_device"] == 8  # 8 KV heads cannot split 16 ways: every GPU keeps all
    assert r["memory"]["kv_bytes_per_token_per_device"] == 131072
    assert r["layout"]["notes"] == ["kv_heads (size 8) is replicated: fewer than the devices of its mesh axes"]


def test_cli_json_table_and_exit_status(capsys):
    assert main(["--model", "llama3-70b", "--tp", "4", "--context_len", "8000", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["max_concurrent_sequences"] == 62 and out["fits"]
    assert main(["--model", "llama3-70b", "--device", "h100-sxm"]) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "weights need 141.11 GB per device" in text
    assert main(["--model", "llama3-8b", "--device", "tpu-v9"]) == 2
    assert "unknown device" in capsys.readouterr().err


def test_cli_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "roof.png"
    assert main(["--model", "llama3-8b", "--batch", "8", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert f"roofline plot written to {path}" in capsys.readouterr().out


def test_measure_compiles_the_layout_and_agrees_with_the_prediction(capsys):
    assert main(["--model", "tiny", "--tp", "4", "--batch", "2", "--context_len", "64", "--measure",
                 "--format", "json"]) == 0
    m = json.loads(capsys.readouterr().out)["measured"]
    assert m["mesh"].endswith("over 4 device(s)")
    assert m["collectives"]["per_layer"] == m["predicted_collectives"]["per_layer"] == {"all-reduce": 2}
    assert m["collectives"]["outside_layers"] == {"all-reduce": 1}
    assert m["collectives"]["total"] == {"all-reduce": 2 * 4 + 1}
    # Compiled argument bytes = weights + cache per device (+ a few hundred bytes of metadata).
    assert m["memory_per_device"]["argument"] == pytest.approx(m["predicted_per_device"]["argument_bytes"],
                                                               rel=0.01)
    assert main(["--model", "tiny", "--tp", "16", "--measure", "--format", "json"]) == 1  # 4 heads / 16
