"""Tiny reasoning checkpoints in the Hugging Face format: a random Llama whose tokenizer and chat
template follow Qwen3's (think and tool-call tags as single added tokens) or DeepSeek-R1's (the
same tags as plain text, several tokens each, so every tag can be split across tokens).

Both templates open the think block in the generation prompt (a random model would never write
`<think>` itself), and close it at once when `enable_thinking` is false (Qwen3's switch); an
assistant message's `reasoning_content` is rendered as a think block (as Qwen3's template renders
the turns after the last user message); tools are listed Qwen-style and calls written as
`<tool_call>{...}</tool_call>` (the hermes format).
"""

from __future__ import annotations

import json
import os

from hf_tokenizer_styles import save_style

THINK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t['function'] | tojson }}\n"
    "{% endfor %}</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{% if m['role'] == 'tool' %}<tool_response>\n"
    "{{ m['content'] }}\n</tool_response>{% else %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
VOCAB = 448  # the model's vocabulary: the tokenizer's 420 and the added tokens, padded
# The engine every test of these checkpoints uses: one token bucket and one context bucket, the same in
# every module, so the step programs compile once per run (the compilation cache has them after).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, num_pages=160, page_size=8,
              max_model_len=640, min_context_bucket=640)


def save_reasoning_checkpoint(hf_dir: str, out_dir: str, added_tags: bool, seed: int = 7) -> str:
    """Writes the HF checkpoint to `hf_dir`, converts it to this project's format in `out_dir`."""
    from tokenizers import AddedToken, Tokenizer

    from model.convert_hf import convert
    from test_hf_parity import make_hf_model, save_hf

    save_style("bytelevel_nobos", hf_dir)
    path = os.path.join(hf_dir, "tokenizer.json")
    if added_tags:
        tok = Tokenizer.from_file(path)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
        tok.save(path)
    conf_path = os.path.join(hf_dir, "tokenizer_config.json")
    with open(conf_path) as f:
        conf = json.load(f)
    conf["chat_template"] = THINK_TEMPLATE
    conf["eos_token"] = "<|im_end|>"
    with open(conf_path, "w") as f:
        json.dump(conf, f)
    model = make_hf_model(seed=seed, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2)
    save_hf(model, hf_dir)
    convert(hf_dir, out_dir, dtype="float32", progress=False)
    return out_dir
