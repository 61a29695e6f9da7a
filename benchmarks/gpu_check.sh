#!/usr/bin/env bash
# One prepared check for a lent NVIDIA GPU (sized for an H200, < 10 minutes end to end):
# device copy bandwidth and bf16 matmul rate, Pallas kernel parity with the references,
# achieved bandwidth of the attention kernel vs the XLA-compiled reference for decode and
# mixed batches (Llama-3-8B attention shapes; benchmarks/kernel_bench.py), batch-1 decode
# with bf16 / int8 / fp8 / block-scaled fp8 weights (gpu_quant_decode.py), one MoE layer grouped (ragged_dot)
# against its dense reference (moe_layer_bench.py), and full-model decode MBU,
# prefill MFU and engine throughput (gpu_model_bench.py), offline throughput of a 1B model with
# LoRA off, on, one adapter and four adapters mixed in every step (lora_bench.py), and the 8B
# server's cold and warm time to /health and first token (startup.py). Each part has a soft budget (it starts nothing
# new after it) or a hard timeout; together at most 580 s.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]          # default: $OUT, else benchmarks/results
#   bash benchmarks/gpu_check.sh --smoke [OUT_DIR]  # CPU: tiny shapes, interpret-mode kernels
#
# Writes OUT_DIR/kernel_bench.json and OUT_DIR/kernel_bench.log. Exit status: 0 when every
# parity check passed, 1 when one failed, 2 when no GPU-enabled jax was found.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=()
if [ "${1:-}" = "--smoke" ]; then
  SMOKE=(--smoke)
  shift
fi
OUT_DIR="${1:-${OUT:-benchmarks/results}}"
mkdir -p "$OUT_DIR"

# The first interpreter whose jax sees a GPU (a carried CPU-only venv is skipped).
PY="${PYTHON:-}"
if [ -z "$PY" ] && [ ${#SMOKE[@]} -gt 0 ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
if [ -z "$PY" ]; then
  for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' >/dev/null 2>&1; then
      PY="$cand"
      break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no python with a GPU-enabled jax (pip install -e '.[cuda12]')" >&2
  exit 2
fi

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null || true
"$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'

# Leave the allocator room for the reference's gathers at the largest case (~8 GB of K/V).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The script stops starting cases after --budget-s; the timeout is the hard stop.
timeout 115 "$PY" -u benchmarks/kernel_bench.py "${SMOKE[@]}" --out "$OUT_DIR" --budget-s 85 2>&1 |
  tee "$OUT_DIR/kernel_bench${SMOKE:+_smoke}.log"
status=${PIPESTATUS[0]}
if [ "$status" = 124 ]; then
  echo "gpu_check: hit the 115 s timeout; partial results in the log under $OUT_DIR" >&2
fi
timeout 95 "$PY" -u benchmarks/gpu_quant_decode.py "${SMOKE[@]}" --out "$OUT_DIR" --budget-s 70 2>&1 | tee "$OUT_DIR/gpu_quant_decode${SMOKE:+_smoke}.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 40 "$PY" -u benchmarks/moe_layer_bench.py "${SMOKE[@]}" --out "$OUT_DIR" --budget-s 25 2>&1 | tee "$OUT_DIR/moe_layer${SMOKE:+_smoke}.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 170 "$PY" -u benchmarks/gpu_model_bench.py "${SMOKE[@]}" --out "$OUT_DIR" --budget-s 140 2>&1 | tee "$OUT_DIR/gpu_model_bench${SMOKE:+_smoke}.log" || status=1
# LoRA: the same workload through the plain engine and four adapters' engine (random 1B weights; the
# embedded model in --smoke, which has the startup part's time: CPU compiles are slow on a shared machine).
# JAX_PLATFORMS empty: the script would otherwise default to CPU.
if [ ${#SMOKE[@]} -eq 0 ]; then
  LORA_ARGS=(--model llama3-1b --no_warmup --rounds 2 --out "$OUT_DIR/lora_bench_gpu.json")
  LORA_TIMEOUT=45
else
  LORA_ARGS=(--smoke --out "$OUT_DIR/lora_bench_smoke.json")
  LORA_TIMEOUT=150
fi
JAX_PLATFORMS="${JAX_PLATFORMS-}" timeout "$LORA_TIMEOUT" "$PY" -u benchmarks/lora_bench.py "${LORA_ARGS[@]}" 2>&1 |
  tee "$OUT_DIR/lora_bench${SMOKE:+_smoke}.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
# Server startup of the 8B shape, cold and warm (not in --smoke: it starts real servers).
if [ ${#SMOKE[@]} -eq 0 ]; then
  timeout 115 "$PY" -u benchmarks/startup.py --platform gpu --models llama3-8b --layer_loops auto \
    --no-cold_wait_ready --out "$OUT_DIR/startup_gpu.json" 2>&1 | tee "$OUT_DIR/startup_gpu.log"
fi
exit "$status"
