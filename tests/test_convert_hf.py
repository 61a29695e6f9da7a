"""model.convert_hf: weight layouts, bf16 input, tokenizer files, and clear failures on bad input.

Every bad input must end in one `ConversionError` (one `error:` line and exit
status 1 from the command line, no traceback) before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.numpy import save_file  # noqa: E402

from model.checkpoint import load_checkpoint  # noqa: E402
from model.convert_hf import ConversionError, convert  # noqa: E402
from model.params import flatten_params  # noqa: E402
from test_hf_parity import make_hf_model, save_hf  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=7, **SMALL)


@pytest.fixture(scope="module")
def good_dir(hf_model, tmp_path_factory):
    """A valid HF directory; tests copy it before breaking it."""
    return save_hf(hf_model, str(tmp_path_factory.mktemp("hf_good")))


@pytest.fixture
def hf_copy(good_dir, tmp_path):
    path = str(tmp_path / "hf")
    shutil.copytree(good_dir, path)
    return path


def run_cli(hf_dir, out_dir, *extra):
    return subprocess.run([sys.executable, "-m", "model.convert_hf", f"--hf_dir={hf_dir}", f"--out_dir={out_dir}",
                           "--noprogress", *extra], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def edit_config(hf_dir, **changes):
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def expect_error(hf_dir, out_dir, *fragments):
    with pytest.raises(ConversionError) as err:
        convert(hf_dir, out_dir, progress=False)
    for fragment in fragments:
        assert fragment in str(err.value)
    assert not os.path.exists(os.path.join(out_dir, "params")), "a failed conversion wrote weights"
    return str(err.value)


# --- happy paths ---

def test_layouts_match_hf_tensors(hf_model, good_dir, tmp_path):
    cfg = convert(good_dir, str(tmp_path), dtype="float32", progress=False)
    _, params = load_checkpoint(str(tmp_path))
    ours = {k: np.asarray(v) for k, v in flatten_params(params).items()}
    hf = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    d, layer = cfg.head_dim, "model.layers.1."
    # Both sides store linear weights [out, in]: head h of wq/wk/wv is a block of HF's rows, head h of
    # wo a block of HF's columns, and the MLP and head weights are HF's tensors exactly.
    for h in range(cfg.num_heads):
        np.testing.assert_array_equal(ours["layers.1.wq"][h], hf[layer + "self_attn.q_proj.weight"][h * d:(h + 1) * d])
        np.testing.assert_array_equal(ours["layers.1.wo"][:, h, :], hf[layer + "self_attn.o_proj.weight"][:, h * d:(h + 1) * d])
    for h in range(cfg.num_kv_heads):
        np.testing.assert_array_equal(ours["layers.1.wk"][h], hf[layer + "self_attn.k_proj.weight"][h * d:(h + 1) * d])
        np.testing.assert_array_equal(ours["layers.1.wv"][h], hf[layer + "self_attn.v_proj.weight"][h * d:(h + 1) * d])
    np.testing.assert_array_equal(ours["layers.1.w_gate"], hf[layer + "mlp.gate_proj.weight"])
    np.testing.assert_array_equal(ours["layers.1.w_up"], hf[layer + "mlp.up_proj.weight"])
    np.testing.assert_array_equal(ours["layers.1.w_down"], hf[layer + "mlp.down_proj.weight"])
    np.testing.assert_array_equal(ours["layers.1.attn_norm"], hf[layer + "input_layernorm.weight"])
    np.testing.assert_array_equal(ours["layers.1.mlp_norm"], hf[layer + "post_attention_layernorm.weight"])
    np.testing.assert_array_equal(ours["embed"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ours["final_norm"], hf["model.norm.weight"])
    np.testing.assert_array_equal(ours["lm_head"], hf["lm_head.weight"])


def test_bf16_safetensors(hf_model, tmp_path):
    """bf16 input keeps bf16 by default (from the config's dtype) and upcasts exactly to fp32."""
    model = make_hf_model(seed=7, **SMALL).to(torch.bfloat16)
    hf_dir = save_hf(model, str(tmp_path / "hf"))
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    assert "bfloat16" in (hf_cfg.get("dtype"), hf_cfg.get("torch_dtype"))
    expected = model.state_dict()["model.layers.0.mlp.gate_proj.weight"].float().numpy()

    cfg16 = convert(hf_dir, str(tmp_path / "bf16"), progress=False)
    assert cfg16.dtype == "bfloat16"
    _, p16 = load_checkpoint(str(tmp_path / "bf16"))
    assert p16.layers[0].w_gate.dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(np.asarray(p16.layers[0].w_gate, np.float32), expected)

    cfg32 = convert(hf_dir, str(tmp_path / "fp32"), dtype="float32", progress=False)
    assert cfg32.dtype == "float32"
    _, p32 = load_checkpoint(str(tmp_path / "fp32"))
    assert p32.layers[0].w_gate.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(p32.layers[0].w_gate), expected)


def test_tokenizer_files_are_carried(hf_copy, tmp_path):
    files = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"eos_token": "</s>"}',
             "chat_template.jinja": "{{ messages }}"}
    for name, text in files.items():
        with open(os.path.join(hf_copy, name), "w") as f:
            f.write(text)
    out = tmp_path / "out"
    convert(hf_copy, str(out), progress=False)
    for name, text in files.items():
        assert (out / name).read_text() == text
    assert (out / "model_config.json").exists()


def test_tied_checkpoint_with_stored_head_and_rope_buffers(tmp_path):
    """Some exporters store lm_head.weight for tied models, or rotary inv_freq buffers: both are skipped."""
    tied = dict(SMALL, tie_word_embeddings=True)
    hf_dir = save_hf(make_hf_model(seed=3, **tied), str(tmp_path / "hf"))
    from safetensors import safe_open

    path = os.path.join(hf_dir, "model.safetensors")
    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    save_file(tensors, path)
    cfg = convert(hf_dir, str(tmp_path / "out"), progress=False)
    assert cfg.tie_word_embeddings
    _, params = load_checkpoint(str(tmp_path / "out"))
    assert params.lm_head is None


# --- bad input ---

def test_nonexistent_directory(tmp_path):
    expect_error(str(tmp_path / "nope"), str(tmp_path / "out"), "is not a directory")


def test_missing_config(hf_copy, tmp_path):
    os.remove(os.path.join(hf_copy, "config.json"))
    expect_error(hf_copy, str(tmp_path / "out"), "no config.json")


def test_non_llama_architecture_cli(tmp_path):
    """A GPT-2 directory, through the command line: exit status 1, one line, no traceback."""
    hf_dir = tmp_path / "gpt2"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
        "vocab_size": 100}))
    proc = run_cli(hf_dir, tmp_path / "out")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unsupported architecture" in lines[0] and "gpt2" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_missing_directory_cli(tmp_path):
    proc = run_cli(tmp_path / "nope", tmp_path / "out")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "is not a directory" in proc.stderr


def test_llama_with_biases_is_refused(hf_copy, tmp_path):
    edit_config(hf_copy, attention_bias=True)
    expect_error(hf_copy, str(tmp_path / "out"), "biases")


def test_missing_weights(hf_copy, tmp_path):
    os.remove(os.path.join(hf_copy, "model.safetensors"))
    expect_error(hf_copy, str(tmp_path / "out"), "no safetensors weights")
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"\0")
    expect_error(hf_copy, str(tmp_path / "out"), "re-save the model with safetensors")


def test_shape_mismatch(hf_copy, tmp_path):
    edit_config(hf_copy, intermediate_size=48)
    msg = expect_error(hf_copy, str(tmp_path / "out"), "model.layers.0.mlp.gate_proj.weight", "[40, 32]", "[48, 32]")
    assert "intermediate=48" in msg


def test_wrong_head_count(hf_copy, tmp_path):
    edit_config(hf_copy, num_key_value_heads=1)
    expect_error(hf_copy, str(tmp_path / "out"), "k_proj.weight", "[16, 32]", "[8, 32]")


def test_missing_tensors(hf_copy, tmp_path):
    edit_config(hf_copy, num_hidden_layers=3)
    expect_error(hf_copy, str(tmp_path / "out"), "missing tensors", "model.layers.2.")


def test_unexpected_tensors(hf_copy, tmp_path):
    edit_config(hf_copy, num_hidden_layers=1)
    expect_error(hf_copy, str(tmp_path / "out"), "unexpected tensors", "model.layers.1.")


def test_truncated_weights_file(hf_copy, tmp_path):
    path = os.path.join(hf_copy, "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    expect_error(hf_copy, str(tmp_path / "out"), "cannot read", "model.safetensors")


def test_index_names_missing_shard(good_dir, tmp_path):
    hf_dir = str(tmp_path / "hf")
    save_hf(make_hf_model(seed=7, **SMALL), hf_dir, max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    assert len(shards) > 1
    os.remove(os.path.join(hf_dir, shards[-1]))
    expect_error(hf_dir, str(tmp_path / "out"), "missing", shards[-1])


def test_integer_tensor_is_refused(hf_copy, tmp_path):
    path = os.path.join(hf_copy, "model.safetensors")
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
    save_file(tensors, path)
    expect_error(hf_copy, str(tmp_path / "out"), "model.norm.weight", "I8")


def test_out_dir_is_a_file(hf_copy, tmp_path):
    out = tmp_path / "file"
    out.write_text("x")
    with pytest.raises(ConversionError, match="not a directory"):
        convert(hf_copy, str(out), progress=False)
    assert out.read_text() == "x"
