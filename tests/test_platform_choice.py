"""A CPU machine with the CUDA plugin installed serves on the CPU without the plugin's start-up error.

The real plugin (`jax[cuda12]`) is gigabytes; a stand-in package `jax_plugins.xla_cuda12` raises from
`initialize()` as the real one does without a driver (`cuInit(0) failed`) unless its driver check is
skipped, which is what a machine without a GPU shows on every start.
"""

import os
import subprocess
import sys

from serving import platform_choice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAND_IN = '''import os


def initialize():
    if not os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        raise RuntimeError("cuInit(0) failed: Unknown CUDA error 303")
'''


def test_the_cpu_is_chosen_only_for_a_cuda_plugin_without_a_device_or_a_choice():
    def choice(environ=None, plugins=("jax_plugins.xla_cuda12",), nodes=()):
        return platform_choice.cpu_instead_of_cuda(environ or {}, lambda name: name in plugins,
                                                   lambda path: path in nodes)

    assert choice() == "jax_plugins.xla_cuda12"
    assert choice(plugins=()) is None  # no plugin: nothing to avoid
    assert choice(nodes=("/dev/nvidiactl",)) is None  # a GPU machine: the plugin serves
    assert choice(environ={"JAX_PLATFORMS": "cuda"}) is None  # the user chose
    assert choice(environ={"JAX_PLATFORMS": "cpu"}) is None


def _first_devices(tmp_path, choose: bool) -> subprocess.CompletedProcess:
    package = tmp_path / "jax_plugins" / "xla_cuda12"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(STAND_IN)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), ROOT])
    code = ("import logging\nlogging.basicConfig(level=logging.INFO)\n"
            + ("from serving import platform_choice\nplatform_choice.choose()\n" if choose else "")
            + "import jax\nprint('devices', [d.platform for d in jax.devices()])\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_machine_with_the_plugin_and_no_gpu_starts_on_the_cpu_without_the_plugin_error(tmp_path):
    if any(os.path.exists(p) for p in platform_choice.NVIDIA_DEVICE_NODES):
        import pytest

        pytest.skip("this machine has an NVIDIA device: the plugin is wanted here")
    plain = _first_devices(tmp_path, choose=False)  # what a start looked like
    assert "cuInit(0) failed" in plain.stderr and "devices ['cpu']" in plain.stdout
    chosen = _first_devices(tmp_path, choose=True)
    assert chosen.returncode == 0, chosen.stderr[-2000:]
    assert "devices ['cpu']" in chosen.stdout
    assert "Traceback" not in chosen.stderr and "cuInit" not in chosen.stderr, chosen.stderr[-2000:]
    assert "no NVIDIA GPU: serving on the CPU" in chosen.stderr


def test_the_server_makes_the_choice_before_it_loads(tmp_path):
    """The server's start (here one that the engine refuses after the model loaded, so it ends quickly)
    logs no plugin error on such a machine."""
    if any(os.path.exists(p) for p in platform_choice.NVIDIA_DEVICE_NODES):
        import pytest

        pytest.skip("this machine has an NVIDIA device: the plugin is wanted here")
    _first_devices(tmp_path, choose=False)  # writes the stand-in plugin
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), ROOT])
    proc = subprocess.run([sys.executable, "-m", "serving.server", "--port=0", "--max_model_len=128", "--num_pages=2",
                           "--page_size=16"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cuInit" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "no NVIDIA GPU: serving on the CPU" in proc.stderr
