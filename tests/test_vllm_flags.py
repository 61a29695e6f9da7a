"""vLLM's flag spellings (`serving.vllm_flags`): every flag of the table parses and sets what it means,
the unsupported ones are refused with a message, unknown ones get the nearest spelling, and
docs/vllm_flags.md shows the table. Flags are parsed into a fresh `FlagValues` (no engine starts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from absl import flags

from serving import server, vllm_flags
from serving.core import engine_args
from test_server_binary import assert_refused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(*args: str) -> flags.FlagValues:
    """The server's flags after `args` (vLLM's spellings translated), as `serving.server` parses them."""
    fv = flags.FlagValues()
    server.define_flags(fv)
    server.model_from_arguments(fv(server.translate_vllm_flags(["serve", *args], fv)), fv)
    return fv


# (vLLM command line, {Ridgeline flag: the value it must have}); one row or more per flag of the table.
CASES = [
    (["--model", "/ckpt"], {"checkpoint": "/ckpt"}),
    (["--host", "0.0.0.0"], {"host": "0.0.0.0"}),
    (["--port", "9001"], {"port": 9001}),
    (["--api-key", "k1", "k2"], {"api_key": "k1,k2"}),
    (["--served-model-name", "m"], {"served_model_name": "m"}),
    (["--max-model-len", "4k"], {"max_model_len": 4000}),
    (["--max-model-len=2K"], {"max_model_len": 2048}),
    (["--max-model-len", "auto"], {"max_model_len": None}),
    (["--tensor-parallel-size", "4"], {"tensor_parallel_size": 4}),
    (["-tp", "2"], {"tensor_parallel_size": 2}),
    (["--pipeline-parallel-size", "2"], {"pipeline_parallel_size": 2}),
    (["-pp", "3"], {"pipeline_parallel_size": 3}),
    (["--data-parallel-size", "1"], {}),
    (["--gpu-memory-utilization", "0.5"], {"kv_cache_memory_fraction": 0.5}),
    (["--max-num-seqs", "7"], {"max_num_seqs": 7}),
    (["--max-num-batched-tokens", "2k"], {"max_num_batched_tokens": 2000}),
    (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--enable-chunked-prefill"], {}),
    (["--kv-cache-dtype", "fp8_e4m3"], {"kv_cache_dtype": "fp8"}),
    (["--kv-cache-dtype", "bfloat16"], {"kv_cache_dtype": "bfloat16"}),
    (["--dtype", "half"], {"dtype": "float16"}),
    (["--dtype", "float"], {"dtype": "float32"}),
    (["--quantization", "fp8"], {"weight_dtype": "fp8"}),
    (["-q", "fp8"], {"weight_dtype": "fp8"}),
    (["--seed", "5"], {"seed": 5}),
    (["--logprobs-mode", "processed_logprobs"], {"logprobs_mode": "processed_logprobs"}),
    (["--chat-template", "{{ messages }}"], {"chat_template": "{{ messages }}"}),
    (["--generation-config", "vllm"], {"generation_config": "off"}),
    (["--generation-config", "auto"], {"generation_config": "auto"}),
    (["--enable-lora"], {"enable_lora": True}),
    (["--lora-modules", "a=/p", '{"name": "b", "path": "/q"}'], {"lora_modules": "a=/p,b=/q"}),
    (["--max-lora-rank", "32"], {"max_lora_rank": 32}),
    (["--max-loras", "3"], {"max_loras": 3}),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     {"speculative_method": "ngram", "num_speculative_tokens": 3, "speculative_model": None}),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, '
      '"prompt_lookup_min": 1}'], {"speculative_method": "ngram", "num_speculative_tokens": 2}),
    (["--speculative-config", '{"model": "/draft", "num_speculative_tokens": 2}'],
     {"speculative_method": "draft", "num_speculative_tokens": 2, "speculative_model": "/draft"}),
    (["--tool-call-parser", "hermes"], {"tool_call_parser": "hermes"}),
    (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"], {"tool_call_parser": "llama3_json"}),
    (["--reasoning-parser", "qwen3"], {"reasoning_parser": "qwen3"}),
    (["--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": false}'],
     {"structured_outputs_whitespace": True}),
    (["--structured-outputs-config", '{"backend": "auto", "reasoning_parser": "deepseek_r1"}'],
     {"reasoning_parser": "deepseek_r1"}),
    (["--disable-log-requests"], {}),
    (["--uvicorn-log-level", "warning"], {"uvicorn_log_level": "warning"}),
    (["--api-server-count", "1"], {}),
    (["--runner", "pooling"], {"runner": "pooling"}),
    (["--convert", "embed"], {"runner": "pooling"}),
    (["--convert", "none"], {}),
    (["--task", "score"], {"runner": "pooling"}),
    (["--task", "generate"], {"runner": "generate"}),
    (["--pooler-config", '{"pooling_type": "MEAN"}'], {"pooler_config": '{"pooling_type": "MEAN"}'}),
    # Dashed spellings of Ridgeline's own flags, and a first argument that is the model.
    (["--page-size", "8", "--no-async-scheduling"], {"page_size": 8, "async_scheduling": False}),
    (["/models/m", "--max-num-seqs", "3"], {"checkpoint": "/models/m", "max_num_seqs": 3}),
]


@pytest.mark.parametrize("argv, want", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_each_flag_parses_and_takes_effect(argv, want):
    fv = parse(*argv)
    defaults = parse()
    llm_kwargs = engine_args.from_flags(fv)
    for name, value in want.items():
        got = llm_kwargs[name] if name in engine_args.BY_NAME else getattr(fv, name)
        assert got == value, (name, got)
    changed = {n for n in fv if getattr(fv, n) != getattr(defaults, n)}
    assert changed == {n for n, v in want.items() if v != getattr(defaults, n)}  # and nothing else


def test_every_flag_of_the_table_has_a_case():
    tried = set()
    for argv, _ in CASES:
        for arg in argv:
            name = arg.lstrip("-").partition("=")[0]
            flag, _ = vllm_flags._lookup(name, arg.startswith("--")) if arg.startswith("-") else (None, None)
            if flag is not None:
                tried.add(flag.name)
    assert tried == set(vllm_flags.BY_NAME)


def test_the_issues_flags_are_all_in_the_table():
    listed = ("host port api-key served-model-name max-model-len tensor-parallel-size pipeline-parallel-size "
              "data-parallel-size gpu-memory-utilization max-num-seqs max-num-batched-tokens enable-prefix-caching "
              "enable-chunked-prefill kv-cache-dtype dtype quantization seed chat-template generation-config "
              "enable-lora lora-modules max-lora-rank max-loras speculative-config tool-call-parser "
              "enable-auto-tool-choice reasoning-parser structured-outputs-config disable-log-requests "
              "uvicorn-log-level api-server-count").split()
    assert set(listed) <= set(vllm_flags.BY_NAME)


def test_every_target_is_a_flag_the_server_defines():
    fv = flags.FlagValues()
    server.define_flags(fv)
    for f in vllm_flags.VLLM_FLAGS:
        for spelled in re.findall(r"--(\w+)", f.ours):
            assert spelled in fv, (f.name, spelled)


@pytest.mark.parametrize("argv, words", [
    (["--data-parallel-size", "2"], ["--data-parallel-size", "not supported", "serving.router"]),
    (["-dp", "4"], ["-dp", "not supported"]),
    (["--api-server-count", "2"], ["--api-server-count", "not supported"]),
    (["--no-enable-chunked-prefill"], ["--no-enable-chunked-prefill", "always chunked"]),
    (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype", "fp8_e5m2"]),
    (["--quantization", "awq"], ["--quantization", "'awq' is not supported"]),
    (["--generation-config", "/some/folder"], ["--generation-config", "folder"]),
    (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "(0, 1]"]),
    (["--max-model-len", "lots"], ["--max-model-len", "4k"]),
    (["--speculative-config", '{"method": "eagle3", "model": "x"}'], ["--speculative-config", "eagle3"]),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 5}'], ["prompt_lookup_max=5", "1 to 4"]),
    (["--speculative-config", '{"method": "ngram", "num_lookahead_slots": 4}'], ["num_lookahead_slots"]),
    (["--speculative-config", "{bad json"], ["--speculative-config", "invalid JSON"]),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], ["xgrammar", "llguidance"]),
    (["--served-model-name", "a", "b"], ["--served-model-name", "one name"]),
    (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice", "--tool-call-parser"]),
    (["--max-modle-len", "5"], ["--max-modle-len", "unknown flag", "did you mean --max-model-len"]),
    (["--tensor-paralel-size=2"], ["did you mean --tensor-parallel-size"]),
])
def test_unsupported_and_unknown_flags_are_refused_with_a_message(argv, words):
    with pytest.raises(ValueError) as err:
        parse(*argv)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_ridgeline_spellings_still_go_to_absl():
    fv = parse("--max_model_len=64", "--noenable_prefix_caching")
    assert fv.max_model_len == 64 and not fv.enable_prefix_caching
    with pytest.raises(flags.Error, match="max_modle_len"):  # absl's own unknown-flag error
        parse("--max_modle_len=64")


def test_chat_template_reads_a_file_or_takes_the_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert server.chat_template_from_flags(parse("--chat-template", str(path))) == path.read_text()
    assert server.chat_template_from_flags(parse("--chat-template", "{{ x }}")) == "{{ x }}"
    with pytest.raises(ValueError, match="no such file"):
        server.chat_template_from_flags(parse("--chat-template", str(tmp_path / "missing.jinja")))


def test_model_and_checkpoint_together_are_refused():
    with pytest.raises(ValueError, match="pass one"):
        parse("/a", "--checkpoint=/b")


def test_the_docs_show_the_table():
    with open(os.path.join(ROOT, "docs", "vllm_flags.md")) as f:
        assert vllm_flags.markdown_table() in f.read()


def test_the_binary_refuses_a_vllm_flag_it_cannot_honour_in_one_line():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "serving.server", "--data-parallel-size", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert_refused(proc, "--data-parallel-size", "not supported")
    assert "loading" not in proc.stderr
