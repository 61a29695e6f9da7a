"""Which JAX platform a process serves on, chosen before JAX starts its backends.

A machine may have the CUDA plugin installed (the `cuda12` extra, or a shared
image) and no NVIDIA GPU: a CPU build machine, a laptop. There JAX's plugin
start-up fails (`cuInit(0) failed`) and logs a traceback on every start,
although serving then goes on on the CPU. A server should say what it does
instead: with a CUDA plugin present, no NVIDIA device node, and no platform
chosen by the user (`JAX_PLATFORMS`), it serves on the CPU, skips the plugin's
driver check (`JAX_SKIP_CUDA_CONSTRAINTS_CHECK`, which is what raises) and
says so in one log line.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Callable, Optional

log = logging.getLogger(__name__)

CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13", "jax_cuda12_plugin", "jax_cuda13_plugin")
NVIDIA_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0")


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or a broken install
        return False


def cpu_instead_of_cuda(environ=os.environ, module_exists: Callable[[str], bool] = _module_exists,
                        path_exists: Callable[[str], bool] = os.path.exists) -> Optional[str]:
    """The CUDA plugin that is installed on a machine without an NVIDIA device, when the user chose no platform
    (so the process should serve on the CPU); None otherwise."""
    if environ.get("JAX_PLATFORMS") or environ.get("JAX_PLATFORM_NAME"):
        return None
    plugin = next((name for name in CUDA_PLUGINS if module_exists(name)), None)
    if plugin is None or any(path_exists(p) for p in NVIDIA_DEVICE_NODES):
        return None
    return plugin


def choose() -> None:
    """Serves on the CPU where `cpu_instead_of_cuda` says so; call before anything asks JAX for a device."""
    plugin = cpu_instead_of_cuda()
    if plugin is None:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    # The plugin's start-up checks the CUDA driver (cuInit) unless told not to: there is none to check.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import jax

    jax.config.update("jax_platforms", "cpu")
    log.info("the CUDA plugin (%s) is installed but this machine has no NVIDIA GPU: serving on the CPU "
             "(set JAX_PLATFORMS to choose a platform)", plugin)
