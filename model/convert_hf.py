"""Converts a Hugging Face checkpoint of a supported family into a ridgeline checkpoint.

Families (`model.families`): Llama, Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3 (text),
Mixtral, Qwen3-MoE, Qwen2.5-VL and Gemma 3 multimodal (their image encoders too, and the image processor's settings from
`preprocessor_config.json`, which is copied with the tokenizer files).

    python -m model.convert_hf --hf_dir=DIR --out_dir=DIR [--dtype=bfloat16] [--weight_dtype=int8|fp8]

Reads `config.json` and the safetensors weights (one `model.safetensors`, or
shards listed by `model.safetensors.index.json`) tensor by tensor through
`safetensors.safe_open`, so the input is never loaded whole. Every tensor's
name and shape is checked against the config *before* any data is read, so a
broken directory fails fast with one message. The family (`model.families`,
looked up by `config.json`'s `architectures`) says which tensors there are.
Each is then renamed to our flat naming (`model.params.flatten_params`), its
head dims split out by a reshape (no transposes: both sides store linear
weights [out, in]) and cast to the target dtype; the source tensor is dropped
before the next one is read, so the converter holds one copy of the model
(the converted one) plus one tensor in flight. The result is an orbax checkpoint written by
`model.checkpoint.save_checkpoint`, plus `model_config.json`, the
tokenizer files and `generation_config.json`.

Scaling note: the converted weights are collected in one host dict and written
by a single orbax save, so host memory must hold the model once (16 GB for 8B
in bf16, 810 GB for 405B), and orbax's serialisation adds a transient copy on
top (for a 433 MB fp32 model the whole conversion peaked at 1.45 GB RSS).
Converting a 405B checkpoint on an ordinary host needs a streaming writer
instead: create the orbax/tensorstore array of each weight up front (the shapes
follow from the config) and write every tensor into it as soon as it is
converted, or split the work by layer across hosts, so that peak memory is one
tensor rather than the model. Restore already reads each device's shard
straight from disk, so only conversion has this limit.

The tensor names and layouts of each family are in its module
(`model.families.llama.checkpoint_tensors`, `model.families.decoder.checkpoint_tensors`:
HF stores `nn.Linear` weights as [out, in], and so do we; only the fused head dims
are split, and Phi-3's fused qkv / gate_up tensors are read once per weight they hold).

`--weight_dtype=int8|fp8` quantizes the linear layers after conversion
(`model.quant`: per-output-channel scales, computed from the float weights
read in fp32 when `--dtype` is float32, else from the converted dtype) and
stores the quantized form; `model_config.json` records it, so `LLM` and the
server load it as it is, at half the bytes of bf16.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors' numpy reader can return it)
import numpy as np
from absl import app, flags, logging
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from model.checkpoint import save_checkpoint
from model.config import ModelConfig, UnsupportedModelError
from model.hf_checks import ConversionError, check_names
from model.families import (ModelFamily, TensorPlan, family_for_config, family_for_hf_config, from_hf_config,
                            num_params)
from model.params import declare_weights, flatten_params, unflatten_params
from model.vision.config import PROCESSOR_FILES, with_processor_settings

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Carried into the converted checkpoint as they are (generation_config.json: default EOS ids and sampling).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json") + PROCESSOR_FILES
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
def conversion_plan(cfg: ModelConfig, family: ModelFamily | None = None) -> list[TensorPlan]:
    """Every tensor a checkpoint of this config must contain, in our order: the names of
    `family` (the one `config.json` named), by default the family that runs `cfg`."""
    return (family or family_for_config(cfg)).checkpoint_tensors(cfg)


def read_hf_config(hf_dir: str, dtype: str | None = None) -> tuple[dict, ModelConfig]:
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir} is not a directory")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir} has no config.json; is it a Hugging Face model directory?")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    from model.quant_formats import checkpoint_format

    quantized = checkpoint_format(hf) is not None  # an unsupported method or variant: a ConversionError
    try:
        return hf, from_hf_config({k: v for k, v in hf.items() if k != "quantization_config"} if quantized else hf,
                                  dtype=dtype)
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from None
    except (ValueError, TypeError, KeyError) as e:
        raise ConversionError(f"invalid config.json: {e}") from None


def weight_files(hf_dir: str) -> dict[str, str]:
    """Maps every stored tensor name to the safetensors file that holds it."""
    index_path = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"cannot read {index_path}: {e!r}") from None
        located = {name: os.path.join(hf_dir, fname) for name, fname in weight_map.items()}
        absent = sorted({p for p in located.values() if not os.path.isfile(p)})
        if absent:
            raise ConversionError(f"{INDEX_FILE} lists shards that are missing: "
                                  f"{[os.path.basename(p) for p in absent]}; download them again")
        return located
    single = os.path.join(hf_dir, SINGLE_FILE)
    files = [single] if os.path.isfile(single) else sorted(
        os.path.join(hf_dir, n) for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        hint = ""
        if any(n.endswith(".bin") or n.endswith(".pth") for n in os.listdir(hf_dir)):
            hint = " (PyTorch .bin/.pth weights are not supported: re-save the model with safetensors)"
        raise ConversionError(f"no safetensors weights in {hf_dir}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")
    located = {}
    for path in files:
        with _open(path) as f:
            names = list(f.keys())
        for name in names:
            if name in located:
                raise ConversionError(f"tensor {name} appears in both {located[name]} and {path}")
            located[name] = path
    return located


def _open(path: str):
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None


# Where transformers 4.52 to 4.57 saved a vision-language model's tensors: the decoder under
# `model.language_model.`, the vision tower under `model.` (the published checkpoints, and transformers
# 5, write `model.layers...` and `visual....`, the names the families plan).
# Gemma 3 multimodal: the published names `language_model.model.`, `vision_tower.vision_model.` and
# `multi_modal_projector.`; transformers 5 writes the tower without `vision_model.`, 4.52-4.57 all
# three under `model.`.
NESTED_PREFIXES = (("model.", "model.language_model."), ("visual.", "model.visual."),
                   ("language_model.model.", "model.language_model."), ("vision_tower.vision_model.", "vision_tower."),
                   ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def stored_names(plan: list[TensorPlan], located: dict[str, str]) -> list[TensorPlan]:
    """`plan` with each tensor named as the checkpoint stores it: its planned name, or failing that the
    nested name of a vision-language model saved by transformers 4.52-4.57."""
    out = []
    for t in plan:
        if t.hf not in located:
            for old, new in NESTED_PREFIXES:
                if t.hf.startswith(old) and new + t.hf[len(old):] in located:
                    t = dataclasses.replace(t, hf=new + t.hf[len(old):])
                    break
        out.append(t)
    return out


def check_tensors(plan: list[TensorPlan], located: dict[str, str], cfg: ModelConfig,
                  family: ModelFamily | None = None) -> None:
    """Validates names, shapes and dtypes from the file headers alone (no tensor data is read)."""
    family = (family or family_for_config(cfg)).name
    check_names(plan, located, cfg, f"a {cfg.num_layers}-layer {family}",
                 f"a {cfg.num_layers}-layer {family} as config.json describes it")
    by_file: dict[str, list[TensorPlan]] = {}
    for t in plan:
        by_file.setdefault(located[t.hf], []).append(t)
    for path, tensors in by_file.items():
        with _open(path) as f:
            for t in tensors:
                info = f.get_slice(t.hf)
                shape, dtype = tuple(info.get_shape()), info.get_dtype()
                if shape != t.hf_shape:
                    raise ConversionError(
                        f"tensor {t.hf} in {os.path.basename(path)} has shape {list(shape)}, but config.json "
                        f"implies {list(t.hf_shape)} (hidden={cfg.hidden_size}, heads={cfg.num_heads}, "
                        f"kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, "
                        f"intermediate={cfg.intermediate_size}, vocab={cfg.vocab_size})")
                if dtype not in FLOAT_DTYPES:
                    raise ConversionError(f"tensor {t.hf} has dtype {dtype}; only float checkpoints "
                                          f"({', '.join(FLOAT_DTYPES)}) are supported")


def read_weights(plan: list[TensorPlan], located: dict[str, str], dtype, progress: bool = True) -> dict:
    """Our flat {name: np.ndarray} in `dtype`, converted one tensor at a time."""
    by_file: dict[str, list[TensorPlan]] = {}
    for t in plan:
        by_file.setdefault(located[t.hf], []).append(t)
    flat = {}
    with tqdm(total=len(plan), desc="converting", unit="tensor", disable=not progress) as bar:
        for path, tensors in by_file.items():
            bar.set_postfix_str(os.path.basename(path))
            with _open(path) as f:
                for t in tensors:
                    try:
                        source = f.get_tensor(t.hf)
                    except (SafetensorError, OSError) as e:
                        raise ConversionError(f"cannot read tensor {t.hf} from {path}: {e}") from None
                    if t.stack is not None:  # one expert of a stacked [experts, ...] weight
                        index, count = t.stack
                        part = t.relayout(source)
                        if t.ours not in flat:
                            flat[t.ours] = np.empty((count,) + part.shape, dtype=dtype)
                        flat[t.ours][index] = part
                    else:
                        # One copy: relayout returns a view, np.array makes it C-contiguous in the target dtype.
                        flat[t.ours] = np.array(t.relayout(source), dtype=dtype, order="C")
                    del source
                    bar.update(1)
    return flat


def weights_from_hf_tensors(tensors, cfg: ModelConfig):
    """Our `Weights` from tensors held in memory under their Hugging Face names (a trainer's state dict),
    by the same plan as a checkpoint directory's (names, shapes, the head-dim relayouts, stacked experts).

    The arrays keep their dtype (the caller's; nothing is cast) and a relayout is a view where it can
    be. A missing or unexpected name, or a shape other than `cfg` implies, is a `ConversionError`
    naming the tensor, raised before any tensor is converted."""
    cfg = cfg.replace(weight_dtype=None)  # HF tensors are float: the plan of the float model
    located = {name: "<tensors>" for name in tensors}
    plan = stored_names(conversion_plan(cfg), located)
    _check_in_memory(plan, tensors, cfg)
    flat: dict = {}
    for t in plan:
        source = tensors[t.hf]
        if t.stack is not None:  # one expert of a stacked [experts, ...] weight
            index, count = t.stack
            part = np.asarray(t.relayout(np.asarray(source)))
            if t.ours not in flat:
                flat[t.ours] = np.empty((count,) + part.shape, dtype=part.dtype)
            flat[t.ours][index] = part
        else:
            flat[t.ours] = t.relayout(source)
    return unflatten_params(cfg, flat)


def _check_in_memory(plan: list[TensorPlan], tensors, cfg: ModelConfig) -> None:
    """`check_tensors` for in-memory tensors: every planned name present with its planned shape, no other."""
    check_names(plan, tensors, cfg, f"a {cfg.num_layers}-layer model", f"this {cfg.num_layers}-layer model",
                 sort_missing=True)
    for t in plan:
        shape = tuple(np.shape(tensors[t.hf]))
        if shape != tuple(t.hf_shape):
            raise ConversionError(f"tensor {t.hf} has shape {list(shape)}, but the model's config implies "
                                  f"{list(t.hf_shape)}")


def copy_tokenizer(hf_dir: str, out_dir: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        src, dst = os.path.join(hf_dir, name), os.path.join(out_dir, name)
        if os.path.isfile(src):
            if not (os.path.exists(dst) and os.path.samefile(src, dst)):
                shutil.copyfile(src, dst)
            copied.append(name)
    return copied


def _with_image_processor(cfg: ModelConfig, hf_dir: str) -> ModelConfig:
    """A vision-language config with the preprocessing settings of the checkpoint's processor file
    (the placeholder count per image depends on them); any other config as it is."""
    if getattr(cfg, "vision", None) is None:
        return cfg
    for name in PROCESSOR_FILES:
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    return cfg.replace(vision=with_processor_settings(cfg.vision, json.load(f)))
            except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
                raise ConversionError(f"cannot read {path}: {e}") from None
    logging.warning("%s has no %s: images are preprocessed with the processor's defaults", hf_dir, PROCESSOR_FILES[0])
    return cfg


def convert(hf_dir: str, out_dir: str, dtype: str | None = None, progress: bool = True,
            weight_dtype: str | None = None) -> ModelConfig:
    """Converts `hf_dir` into a ridgeline checkpoint at `out_dir`; returns its config.

    `dtype` ("float32", "bfloat16", "float16") is both the stored dtype and the
    config's compute dtype; by default it is the HF config's (`dtype` or `torch_dtype`).
    `weight_dtype` ("int8", "fp8"; None keeps floats) stores the linear layers quantized.
    Raises `ConversionError` for anything wrong with the input.
    """
    if weight_dtype not in (None, "auto", "int8", "fp8"):
        raise ConversionError(f"--weight_dtype must be int8 or fp8 (or unset), got {weight_dtype!r}")
    hf, cfg = read_hf_config(hf_dir, dtype)
    cfg = _with_image_processor(cfg, hf_dir)
    family = family_for_hf_config(hf)  # the family config.json names (read_hf_config refused any other)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConversionError(f"--out_dir {out_dir} exists and is not a directory")
    located = weight_files(hf_dir)
    plan = stored_names(conversion_plan(cfg, family), located)
    from model.quant_formats import checkpoint_format, head_quantized, read_quantized

    qformat = checkpoint_format(hf)
    if qformat is not None:  # a published quantized checkpoint: read as the weight kind it maps to
        if weight_dtype not in (None, "auto"):
            raise ConversionError(f"--weight_dtype {weight_dtype}: the checkpoint is already quantized "
                                  f"(quant_method {qformat.method!r})")
        cfg = cfg.replace(weight_dtype=qformat.weight_dtype,
                          float_lm_head=not cfg.tie_word_embeddings and not head_quantized(plan, located, qformat))
        flat = read_quantized(plan, located, cfg, qformat, flatten_params(declare_weights(cfg)))
    else:
        check_tensors(plan, located, cfg, family)
        flat = read_weights(plan, located, np.dtype(cfg.jnp_dtype), progress)
    params = unflatten_params(cfg, flat)
    del flat
    if weight_dtype not in (None, "auto"):
        from model.quantize import quantize_params

        cfg, params = quantize_params(params, cfg, weight_dtype)
    save_checkpoint(out_dir, params, cfg)
    copied = copy_tokenizer(hf_dir, out_dir)
    if "tokenizer.json" not in copied:
        logging.warning("%s has no tokenizer.json: the checkpoint will fall back to the byte tokenizer", hf_dir)
    return cfg


FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags are defined only when this module is the program, so that importing `convert`
    next to other absl programs (model.train also has --out_dir) cannot clash."""
    flags.DEFINE_string("hf_dir", None, "Hugging Face model directory (config.json + *.safetensors).")
    flags.DEFINE_string("out_dir", None, "Where to write the ridgeline checkpoint.")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                      "Stored and compute dtype; default: the dtype in config.json.")
    flags.DEFINE_enum("weight_dtype", None, ["int8", "fp8"],
                      "Store the linear layers quantized (per-output-channel scales); default: float.")
    flags.DEFINE_bool("progress", True, "Show a progress bar.")
    flags.mark_flags_as_required(["hf_dir", "out_dir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not os.environ.get("JAX_PLATFORMS"):
        # Conversion is host work; do not claim (and preallocate) an accelerator.
        import jax

        jax.config.update("jax_platforms", "cpu")
    try:
        cfg = convert(FLAGS.hf_dir, FLAGS.out_dir, FLAGS.dtype, FLAGS.progress, FLAGS.weight_dtype)
    except ConversionError as e:
        print(f"convert_hf: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {FLAGS.out_dir}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{num_params(cfg) / 1e6:.2f}M params, dtype {cfg.dtype}"
          + (f", linear weights {cfg.weight_dtype}" if cfg.weight_dtype else ""))
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
