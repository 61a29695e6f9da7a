"""Upgrades a format-1 checkpoint (linear weights [in, out]) to format 2 ([out, in]).

    python -m model.upgrade_checkpoint --dir=DIR [--out_dir=DIR]

Format 1 stored every linear weight input dims first (wq [embed, heads,
head_dim], w_gate [embed, ffw], lm_head [embed, vocab], ...); format 2 stores
them output dims first, the PyTorch / Hugging Face layout (`model.declarations`).
The upgrade reads each stored array in its stored dtype, permutes its dims,
checks the result against the config's declaration and writes the checkpoint
again with `model.checkpoint.save_checkpoint` (which records format 2). A
quantized weight's data is permuted and its scale kept: the scale holds the
output dims in both formats. Norms and the embedding table are unchanged.

Without `--out_dir` the checkpoint is upgraded in place: the new params are
written beside the old ones and swapped in only once complete.
"""

from __future__ import annotations

import os
import shutil
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from model.checkpoint import (CONFIG_FILE, FORMAT_VERSION, PARAMS_DIR, check_format, load_config, save_checkpoint,
                              stored_format)
from model.params import abstract_params, flatten_params, unflatten_params

# Format 1 -> 2: the axis permutation of each linear weight, by its name's last part.
_V1_TO_V2 = {
    "wq": (1, 2, 0),  # [embed, heads, head_dim] -> [heads, head_dim, embed]
    "wk": (1, 2, 0),
    "wv": (1, 2, 0),
    "wo": (2, 0, 1),  # [q_heads, head_dim, embed] -> [embed, q_heads, head_dim]
    "w_gate": (1, 0),  # [embed, ffw] -> [ffw, embed]
    "w_up": (1, 0),
    "w_down": (1, 0),  # [ffw, embed] -> [embed, ffw]
    "lm_head": (1, 0),  # [embed, vocab] -> [vocab, embed]
}


def v1_to_v2(name: str, array: np.ndarray) -> np.ndarray:
    """One stored array of format 1, in format 2 (a flat name such as "layers.0.wq.data")."""
    parts = name.split(".")
    if parts[-1] == "scale":
        return array
    base = parts[-2] if parts[-1] == "data" else parts[-1]
    perm = _V1_TO_V2.get(base)
    return array if perm is None else np.ascontiguousarray(np.transpose(array, perm))


def read_stored(directory: str) -> tuple[int, dict[str, np.ndarray]]:
    """(format, flat {name: host array in its stored dtype}) of a checkpoint."""
    path = os.path.join(os.path.abspath(directory), PARAMS_DIR)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        tree = getattr(meta.item_metadata, "tree", meta.item_metadata)
        target = {k: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=device) for k, v in tree.items()}
        flat = ckptr.restore(path, target)
    return stored_format(meta), {k: np.asarray(v) for k, v in flat.items()}


def upgrade(directory: str, out_dir: str | None = None) -> int:
    """Writes `directory` (format 1) as format 2 to `out_dir` (default: in place); returns
    the number of arrays permuted. A checkpoint already in format 2 is left as it is."""
    directory = os.path.abspath(directory)
    cfg = load_config(directory)
    version, flat = read_stored(directory)
    if version == FORMAT_VERSION:
        if out_dir is not None and os.path.abspath(out_dir) != directory:
            shutil.copytree(directory, out_dir, dirs_exist_ok=True)
        return 0
    if version != 1:
        check_format(directory, version)  # raises: newer than this code
    new = {k: v1_to_v2(k, v) for k, v in flat.items()}
    want = {k: tuple(v.shape) for k, v in flatten_params(abstract_params(cfg)).items()}
    wrong = [f"{k}: {v.shape} after the upgrade, config expects {want.get(k)}"
             for k, v in new.items() if tuple(v.shape) != want.get(k)]
    if wrong or set(want) != set(new):
        raise ValueError(f"{directory} is not a format-1 checkpoint of its config: "
                         + "; ".join(wrong[:5] or [f"weights differ: {sorted(set(want) ^ set(new))[:5]}"]))
    params = unflatten_params(cfg, new)  # stored dtypes kept: save_checkpoint casts nothing
    if out_dir is not None and os.path.abspath(out_dir) != directory:
        save_checkpoint(out_dir, params, cfg)
        for name in os.listdir(directory):  # tokenizer, reports: everything but the params
            src = os.path.join(directory, name)
            if name not in (PARAMS_DIR, CONFIG_FILE) and os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))
    else:
        staging = directory + ".upgrading"
        save_checkpoint(staging, params, cfg)
        old = os.path.join(directory, PARAMS_DIR)
        shutil.rmtree(old)
        os.replace(os.path.join(staging, PARAMS_DIR), old)
        shutil.rmtree(staging)
    return sum(1 for k in flat if new[k] is not flat[k])


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m model.upgrade_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the checkpoint directory (model_config.json + params/)")
    p.add_argument("--out_dir", default=None, help="where to write the upgraded checkpoint (default: in place)")
    args = p.parse_args(argv)
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")  # host work: do not claim an accelerator
    try:
        n = upgrade(args.dir, args.out_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"upgrade_checkpoint: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.out_dir or args.dir}: format {FORMAT_VERSION}" + (f", {n} arrays permuted" if n else
                                                                      " already, nothing to do"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
