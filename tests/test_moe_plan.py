"""The planner and the utilization metrics on mixtures of experts, against hand computations
from the published shapes (Mixtral-8x7B: 32 layers, hidden 4096, 8 experts of 14336, top 2;
Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts of 768, top 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from model.families import config_by_name
from sharding.estimate import PlanInputs, plan
from sharding.hardware import get_gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (layers, hidden, heads, kv_heads, head_dim, vocab, experts, k, expert ffw, q/k norms)
SHAPES = {"mixtral-8x7b": (32, 4096, 32, 8, 128, 32000, 8, 2, 14336, False),
          "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 151936, 128, 8, 768, True)}


def hand(name):
    L, h, nq, nkv, d, v, e, k, f, qk = SHAPES[name]
    attn = h * nq * d * 2 + h * nkv * d * 2 + (2 * d if qk else 0)
    experts = L * e * 3 * h * f
    per_layer_other = attn + 2 * h + e * h  # norms and router
    total = experts + L * per_layer_other + 2 * v * h + h
    return dict(total=total, experts=experts, active=total - experts + experts * k // e, e=e, k=k,
                kv_token=L * 2 * nkv * d * 2, untied_embed=v * h)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameters_and_decode_bytes_by_batch(name):
    want = hand(name)
    r = plan(PlanInputs(cfg=config_by_name(name), gpu=get_gpu("h100-sxm"), context_len=1000, batch=4,
                        model_name=name))
    assert r["model"]["params"] == want["total"]
    assert r["model"]["active_params"] == want["active"]
    moe = r["moe"]
    assert moe["expert_params"] == want["experts"] and moe["experts_per_device"] == want["e"]
    e, k = want["e"], want["k"]
    dense = (want["total"] - want["experts"] - want["untied_embed"]) * 2  # bf16, embedding only gathered
    for row in moe["decode_bytes_by_batch"]:
        b = row["batch"]
        touched = e * (1 - (1 - k / e) ** b)
        assert row["experts_touched_per_layer"] == pytest.approx(touched)
        assert row["bytes"] == pytest.approx(dense + want["experts"] * 2 * touched / e + want["kv_token"] * 1000 * b)
    # The roofline's decode step is the same sum at the plan's batch; FLOPs use the active parameters.
    row4 = next(row for row in moe["decode_bytes_by_batch"] if row["batch"] == 4)
    assert r["decode"]["bytes_per_device"] == pytest.approx(row4["bytes"])
    assert r["model"]["matmul_flops_per_token"] == 2 * (want["active"] - want["untied_embed"])
    # One token reads the active experts only; a large batch reads all of them.
    assert moe["decode_bytes_by_batch"][0]["expert_bytes"] == pytest.approx(want["experts"] * 2 * k / e)
    assert moe["decode_bytes_by_batch"][-1]["expert_bytes"] <= want["experts"] * 2


def test_expert_parallel_layout_and_collectives_json():
    """`--format=json` carries the MoE figures; EP=4 holds 2 of Mixtral's 8 experts per device,
    and the MLP all-reduce carries fp32 tokens x hidden."""
    proc = subprocess.run([sys.executable, "-m", "sharding.plan", "--model", "mixtral-8x7b", "--tp", "4",
                           "--batch", "1", "--context_len", "1000", "--format=json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode in (0, 1), proc.stderr
    r = json.loads(proc.stdout)
    moe, want = r["moe"], hand("mixtral-8x7b")
    assert (moe["expert_parallel"], moe["experts_per_device"], moe["expert_tensor_parallel"]) == (4, 2, 1)
    assert moe["expert_bytes_per_device"] == pytest.approx(want["experts"] * 2 / 4)
    assert "fp32 all-reduce" in moe["collectives"]
    # Per layer: attention's bf16 all-reduce plus the experts' fp32 one, then the embedding's.
    ring = 2 * 3 / 4
    wire = ring * ((32 + 1) * 4096 * 2 + 32 * 4096 * 4)
    assert r["collectives"]["decode_step"]["nvlink"]["bytes_per_gpu"] == pytest.approx(wire)
    assert r["memory"]["weight_bytes_per_device"] < want["total"] * 2 / 2  # experts split, not replicated


def test_utilization_uses_active_parameters_and_touched_experts():
    from serving.api.http_metrics import ModelCost

    cfg = config_by_name("mixtral-8x7b")
    want = hand("mixtral-8x7b")
    streamed = (want["total"] - want["untied_embed"]) * 2.0
    cost = ModelCost.from_config(cfg, streamed_weight_bytes=streamed)
    norms = 4096 * (2 * 32 + 1)
    assert cost.flops_per_token == 2.0 * (want["active"] - want["untied_embed"] - norms)
    expert_bytes = want["experts"] * 2.0
    assert cost.expert_weight_bytes == pytest.approx(expert_bytes)
    # 10 steps of 1 token read the dense weights and 2 of 8 experts each; of 64 tokens, nearly all.
    dense = streamed - expert_bytes
    assert cost.bytes_read(10, 0, 10) == pytest.approx(10 * (dense + expert_bytes * 0.25))
    assert cost.bytes_read(10, 0, 640) == pytest.approx(10 * (dense + expert_bytes * (1 - 0.75 ** 64)))
    dense_cost = ModelCost.from_config(config_by_name("llama3-8b"))
    assert dense_cost.expert_weight_bytes == 0 and dense_cost.bytes_read(3, 0, 99) == 3 * dense_cost.weight_bytes


def test_a_shared_expert_counts_as_active():
    """Qwen1.5-MoE-A2.7B (24 layers, hidden 2048, 60 experts of 1408, top 4, q/k/v biases, a
    shared expert of 5632 with its sigmoid gate): the published 14.3B total, 2.7B active."""
    L, h, n, d, v, e, k, f, fs = 24, 2048, 16, 128, 151936, 60, 4, 1408, 5632
    attn = 4 * h * n * d + 3 * n * d
    shared = 3 * h * fs + h
    experts = L * e * 3 * h * f
    total = experts + L * (attn + shared + 2 * h + e * h) + 2 * v * h + h
    r = plan(PlanInputs(cfg=config_by_name("qwen1.5-moe-a2.7b"), gpu=get_gpu("h100-sxm"), context_len=1000,
                        batch=4, model_name="qwen1.5-moe-a2.7b"))
    assert r["model"]["params"] == total
    assert r["model"]["active_params"] == total - experts + experts * k // e
    assert round(total / 1e9, 1) == 14.3 and round(r["model"]["active_params"] / 1e9, 1) == 2.7
