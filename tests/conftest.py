"""Test configuration: 8 CPU devices for sharding tests, set before jax is imported."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# Engines started by the tests cache compilations in a fresh directory, never the user's.
os.environ.setdefault("RIDGELINE_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="ridgeline-jax-cache-"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def tiny_config(**overrides):
    """A small random-weight config for tests (not the embedded model's shape)."""
    from model.config import LlamaConfig

    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, rope_theta=10000.0, dtype="float32", max_position_embeddings=1024,
                bos_token_id=1, eos_token_ids=(2,))
    base.update(overrides)
    return LlamaConfig(**base)


@pytest.fixture
def small_cfg():
    return tiny_config()
