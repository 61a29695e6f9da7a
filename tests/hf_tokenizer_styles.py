"""Small tokenizers in the styles real checkpoints ship, saved in the Hugging Face format.

Each is trained on the spot with the `tokenizers` library and written as
`tokenizer.json` + `tokenizer_config.json` + `special_tokens_map.json`, the
files `transformers.AutoTokenizer` and `model.hf_tokenizer.HFTokenizer` read:

* `bytelevel_bos`: GPT-2-style byte-level BPE whose post-processor writes BOS
  (Llama 3's layout, no `add_bos_token` in the config);
* `bytelevel_nobos`: SmolLM / Qwen: byte-level BPE with ChatML tokens, a
  `ByteLevel` post-processor and `add_bos_token` false (no BOS is added);
* `sentencepiece`: Llama 2 / Mistral: `▁` for spaces (prepended by the
  normalizer), byte-fallback `<0xNN>` tokens, `add_bos_token` true;
* `metaspace`: newer Mistral exports: a `Metaspace` pre-tokenizer
  (`prepend_scheme` "first"), byte fallback, BOS from the post-processor;
* `gemma`: `▁` without a prepended one, byte fallback, `<pad>` `<eos>` `<bos>`
  `<unk>` first, turn tokens, and a chat template that writes BOS.

The Llama 2 style config names `PreTrainedTokenizerFast`: transformers 5's
Llama class rebuilds a legacy-normalizer pipeline from the vocabulary and
merges (a Metaspace one) instead of reading the file's, so only the generic
class reads that file as written.
"""

from __future__ import annotations

import json
import os

CORPUS = [
    "the quick brown fox jumps over the lazy dog.", "The capital of France is Paris.",
    "héllo wörld, 日本語のテキスト and emoji 🦙🚀", "def f(x):\n    return x  # two  spaces",
    "naïve café — ünïcode ✓", "中文字符测试，还有标点。", "\n\n\tindented\n  code",
] * 30

STYLES = ("bytelevel_bos", "bytelevel_nobos", "sentencepiece", "metaspace", "gemma")
SPECIALS = {
    "bytelevel_bos": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
    "bytelevel_nobos": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "sentencepiece": ["<unk>", "<s>", "</s>"],
    "metaspace": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA2_TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"


def _byte_level(style):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIALS[style]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if style == "bytelevel_bos":
        bos = specials[0]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
        conf = {"bos_token": specials[0], "eos_token": specials[1], "tokenizer_class": "PreTrainedTokenizerFast"}
    else:  # SmolLM / Qwen-like: a BOS token that is never added
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        conf = {"bos_token": specials[1], "eos_token": specials[2], "unk_token": specials[0],
                "add_bos_token": False, "chat_template": CHATML, "tokenizer_class": "GPT2Tokenizer"}
    return tok, conf


def _sentencepiece(style):
    """BPE over `▁`-marked text with the 256 byte tokens in the vocabulary (SentencePiece's byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = SPECIALS[style]
    trainer_tok = Tokenizer(models.BPE())
    if style == "metaspace":
        trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                             split=False)
    else:
        trainer_tok.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                        normalizers.Replace(" ", "\u2581")])
                                  if style == "sentencepiece" else normalizers.Replace(" ", "\u2581"))
        trainer_tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")  # keeps merges short
    trainer_tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                                special_tokens=[]))
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>" if "<unk>" in vocab else None,
                               byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(specials)
    fuse = [decoders.ByteFallback(), decoders.Fuse()]
    bos = "<bos>" if style == "gemma" else "<s>"
    if style == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    else:
        tok.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
                          if style == "sentencepiece" else normalizers.Replace(" ", "\u2581"))
    strip = [] if style == "gemma" else [decoders.Strip(" ", 1, 0)]
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " ")] + fuse + strip)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, vocab[bos])])
    if style == "gemma":
        conf = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                "add_bos_token": True, "add_eos_token": False, "chat_template": GEMMA_TEMPLATE,
                "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
                "tokenizer_class": "GemmaTokenizer"}
    elif style == "sentencepiece":
        conf = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                "add_eos_token": False, "chat_template": LLAMA2_TEMPLATE, "legacy": False,
                "tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        conf = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizerFast"}
    return tok, conf


def save_style(style: str, directory) -> str:
    """Writes the style's tokenizer files into `directory`; returns it (a str)."""
    tok, conf = _byte_level(style) if style.startswith("bytelevel") else _sentencepiece(style)
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    conf = {"model_max_length": 4096, "clean_up_tokenization_spaces": False, **conf}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f, ensure_ascii=False)
    smap = {k: conf[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in conf}
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump(smap, f)
    return directory
