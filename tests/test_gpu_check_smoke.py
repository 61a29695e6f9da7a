"""`benchmarks/gpu_check.sh --smoke` runs end to end on CPU.

The GPU check is the one script run when a GPU is available, with a few
minutes of device time for all of it; a script broken by a change elsewhere
(a step function's signature, a flag) would waste them. The smoke mode runs
every part on tiny shapes, the kernels in interpret mode, and must exit 0
with every result file written.
"""

import json
import os
import subprocess
import sys
from conftest import SUBPROCESS_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_smoke_writes_every_result(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as the script sees it
    env.update(PYTHON=sys.executable, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--smoke", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    kernels = json.loads((tmp_path / "kernel_bench_smoke.json").read_text())
    assert kernels["parity"] and all(p.get("ok", True) for p in kernels["parity"])
    quant = json.loads((tmp_path / "gpu_quant_decode_smoke.json").read_text())
    assert quant["ok"] and quant["variants"]
    moe = json.loads((tmp_path / "moe_layer_smoke.json").read_text())
    assert moe["ok"] and moe["cases"] and moe["cuda_lowering"].startswith("ok")
    model = json.loads((tmp_path / "gpu_model_bench_smoke.json").read_text())
    assert all("tok_per_s" in d for d in model["decode"])
    assert model["prefill"]["mfu"] > 0
    lora = json.loads((tmp_path / "lora_bench_smoke.json").read_text())
    assert lora["rows"]["4 adapters mixed"]["tokens_per_second"] > 0
    overlap = model["engine_chat"]["overlap"]
    assert overlap["output_tok_per_s_overlapped"] > 0 and overlap["output_tok_per_s_one_at_a_time"] > 0
