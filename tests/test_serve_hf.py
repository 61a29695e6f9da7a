"""`ridgeline serve MODEL` on Hugging Face checkpoints: a directory, and a Hub id from an offline cache
(converted once, the second start finding the converted copy), and the refusals of bad MODELs (one
`error:` line, exit status 2)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from conftest import SUBPROCESS_XLA_FLAGS, interrupt_server, wait_until_serving  # noqa: E402
from hf_tokenizer_styles import save_style  # noqa: E402
from serving import model_source  # noqa: E402
from serving.server import free_port  # noqa: E402
from test_server_binary import assert_refused  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ID = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def save_tiny_hf(directory: str, **config) -> str:
    """A random 1-layer Llama written by transformers, with a byte-level BPE tokenizer and a chat template."""
    from test_hf_parity import make_hf_model, save_hf

    save_style("bytelevel_nobos", directory)
    conf_path = os.path.join(directory, "tokenizer_config.json")
    with open(conf_path) as f:
        conf = json.load(f)
    conf["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with open(conf_path, "w") as f:
        json.dump(conf, f)
    shape = dict(vocab_size=448, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    save_hf(make_hf_model(seed=3, **{**shape, **config}), directory)
    return directory


def put_in_hub_cache(hf_dir: str, hf_home: str, repo_id: str = REPO_ID) -> str:
    """`hf_dir`'s files laid out as huggingface_hub caches a download: blobs named by sha256 (large, LFS files)
    or git blob sha1 (small ones), snapshot links to them, refs/main naming the snapshot's revision."""
    repo = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", REVISION)
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    for name in sorted(os.listdir(hf_dir)):
        with open(os.path.join(hf_dir, name), "rb") as f:
            data = f.read()
        if name.endswith(".safetensors"):
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        with open(os.path.join(repo, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(REVISION)
    return snapshot


def serve_command(*args: str) -> list[str]:
    """`ridgeline serve ARGS` (the console script `pip install -e .` writes), else the module it runs."""
    script = shutil.which("ridgeline", path=os.path.dirname(sys.executable))
    if script:
        return [script, "serve", *args]
    return [sys.executable, "-m", "serving.server", *args]


def server_env(tmp_path, **extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS,
               RIDGELINE_COMPILATION_CACHE_DIR=str(tmp_path / "cache" / "jax"), HF_HOME=str(tmp_path / "hf_home"))
    env.pop("HF_HUB_CACHE", None)
    env.update(extra)
    return env


# The engine of both starts: one small bucket set, so the second start loads its executables from the cache.
SERVE_FLAGS = ("--max-model-len", "512", "--served-model-name", "m", "--api-key", "k", "--max-num-seqs", "2",
               "--max-num-batched-tokens", "32", "--min_token_bucket", "32", "--page_size", "16",
               "--min_context_bucket", "512", "--num_pages", "40", "--attention_backend", "reference")


def serve_and_talk(model: str, env: dict, log_path) -> str:
    """Starts the server on `model`, checks it over the openai client, stops it; returns its log."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_command(model, *SERVE_FLAGS, "--port", str(port)), cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(proc, log_path, timeout=600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", timeout=120)
        assert [m.id for m in client.models.list().data] == ["m"]
        out = client.completions.create(model="m", prompt="the quick brown", max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):  # --api-key took effect
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong").models.list()
        return out.choices[0].text
    finally:
        interrupt_server(proc)
        assert proc.returncode == 0, log_path.read_text()[-3000:]


def test_a_hf_directory_then_the_same_model_by_hub_id_offline_converting_once(tmp_path):
    hf_dir = save_tiny_hf(str(tmp_path / "tiny-llama"))
    env = server_env(tmp_path)
    first_log = tmp_path / "first.log"
    text_from_dir = serve_and_talk(hf_dir, env, first_log)
    first = first_log.read_text()
    assert "converting Hugging Face checkpoint" in first, first[-3000:]
    converted = tmp_path / "cache" / "converted"
    assert len([p for p in converted.iterdir() if p.is_dir()]) == 1  # beside the compilation cache

    put_in_hub_cache(hf_dir, str(tmp_path / "hf_home"))
    second_log = tmp_path / "second.log"
    text_from_hub = serve_and_talk(REPO_ID, dict(env, HF_HUB_OFFLINE="1"), second_log)
    second = second_log.read_text()
    assert "HF_HUB_OFFLINE is set" in second and "from the Hugging Face cache" in second, second[-3000:]
    assert "converting" not in second and "cached, nothing to convert" in second, second[-3000:]
    assert text_from_hub == text_from_dir  # the same weights, greedy
    assert len([p for p in converted.iterdir() if p.is_dir()]) == 1


# --- conversion cache, in process --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return save_tiny_hf(str(tmp_path_factory.mktemp("tiny-hf")))


def test_a_second_resolve_converts_nothing_and_a_changed_file_converts_again(tiny_hf, tmp_path, monkeypatch):
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(tiny_hf, hf_dir)
    cache = str(tmp_path / "cache" / "jax")
    first = model_source.resolve(hf_dir, cache)
    assert os.path.dirname(first.checkpoint) == str(tmp_path / "cache" / "converted")
    assert first.name == "hf" and os.path.isfile(os.path.join(first.checkpoint, "tokenizer.json"))

    import model.convert_hf

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(model.convert_hf, "convert", no_conversion)
    assert model_source.resolve(hf_dir, cache) == first
    monkeypatch.undo()

    with open(os.path.join(hf_dir, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.5}, f)
    changed = model_source.resolve(hf_dir, cache)
    assert changed.checkpoint != first.checkpoint
    with open(os.path.join(changed.checkpoint, "generation_config.json")) as f:
        assert json.load(f) == {"temperature": 0.5}


def test_llm_takes_a_hf_directory_as_model(tiny_hf, tmp_path):
    from serving import LLM, SamplingParams

    llm = LLM(model=tiny_hf, compilation_cache_dir=str(tmp_path / "cache" / "jax"), max_num_seqs=1,
              max_num_batched_tokens=16, num_pages=8, max_model_len=64)
    assert llm.config.num_layers == 1 and llm.config.vocab_size == 448
    assert llm.checkpoint.startswith(str(tmp_path / "cache" / "converted"))
    from serving.server import default_model_name

    assert default_model_name(llm) == os.path.basename(tiny_hf)  # the source's name, not the cache key
    out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_llm_refuses_two_different_models():
    from serving import LLM

    with pytest.raises(ValueError, match="not both"):
        LLM("/a", model="/b")


# --- bad MODELs: one line, exit status 2 ---------------------------------------------------------------------


def _neither(tmp_path) -> str:
    os.makedirs(tmp_path / "notes")
    (tmp_path / "notes" / "README.md").write_text("not a model")
    return str(tmp_path / "notes")


def _missing_shard(tmp_path, tiny_hf) -> str:
    from test_hf_parity import make_hf_model, save_hf

    hf_dir = str(tmp_path / "sharded")
    shutil.copytree(tiny_hf, hf_dir)
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(hf_dir, name))
    model = make_hf_model(seed=3, vocab_size=448, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    save_hf(model, hf_dir, max_shard_size="20KB")
    shards = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    assert len(shards) > 1
    os.remove(os.path.join(hf_dir, shards[-1]))
    return hf_dir


def _unsupported(tmp_path, tiny_hf) -> str:
    hf_dir = str(tmp_path / "gpt2ish")
    shutil.copytree(tiny_hf, hf_dir)
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return hf_dir


@pytest.mark.parametrize("case, words", [
    ("neither", ["is neither a Ridgeline checkpoint", "Hugging Face checkpoint", "Hub id"]),
    ("not_cached", [REPO_ID, "not in the Hugging Face cache", "HF_HUB_OFFLINE", "hf download"]),
    ("missing_shard", ["lists shards that are missing", "download them again"]),
    ("unsupported", ["unsupported architecture", "GPT2LMHeadModel", "supported:"]),
])
def test_a_bad_model_is_one_line_and_exit_status_2(case, words, tiny_hf, tmp_path):
    model = {"neither": lambda: _neither(tmp_path), "not_cached": lambda: REPO_ID,
             "missing_shard": lambda: _missing_shard(tmp_path, tiny_hf),
             "unsupported": lambda: _unsupported(tmp_path, tiny_hf)}[case]()
    proc = subprocess.run(serve_command(model, "--port", str(free_port())), cwd=ROOT,
                          env=server_env(tmp_path, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300)
    assert_refused(proc, *words)


# --- the Hub, online (huggingface_hub's download stood in for: no network here) --------------------------------


def test_online_a_hub_id_is_downloaded_into_the_cache_and_a_missing_repo_named(tiny_hf, tmp_path, monkeypatch):
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    calls = []

    def download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if repo_id != REPO_ID:
            raise RepositoryNotFoundError("404", response=httpx.Response(404, request=httpx.Request("GET", "x")))
        return put_in_hub_cache(tiny_hf, kwargs["cache_dir"].rsplit(os.sep, 1)[0])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    resolved = model_source.resolve(REPO_ID, str(tmp_path / "cache" / "jax"))
    assert resolved.name == REPO_ID and os.path.isfile(os.path.join(resolved.checkpoint, "model_config.json"))
    (repo_id, kwargs), = calls
    assert kwargs["cache_dir"] == str(tmp_path / "hf_home" / "hub") and kwargs["local_files_only"] is False
    assert "*.safetensors" in kwargs["allow_patterns"] and "*.bin" not in kwargs["allow_patterns"]
    with pytest.raises(model_source.ModelSourceError, match="no model other-org/absent on the Hugging Face Hub"):
        model_source.resolve("other-org/absent", str(tmp_path / "cache" / "jax"))
