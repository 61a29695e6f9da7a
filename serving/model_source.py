"""What `MODEL` names (`ridgeline serve MODEL`, `LLM(model=...)`), turned into a Ridgeline checkpoint directory.

`MODEL` is one of:

* a Ridgeline checkpoint directory (it holds `model_config.json`): used as it is;
* a Hugging Face checkpoint directory (`config.json` and safetensors weights):
  converted by `model.convert_hf` on first use, the result cached;
* a Hugging Face Hub id (`org/name`, not an existing path): looked up in the
  Hugging Face cache by `huggingface_hub`, which honours `HF_HOME` /
  `HF_HUB_CACHE`, and downloaded when missing unless `HF_HUB_OFFLINE` is set
  (then only the cache is used, and the log says so); the snapshot is then
  converted as a directory is.

Converted checkpoints live beside the compilation cache
(`serving.compilation.compile_cache`): with the default `~/.cache/ridgeline/jax`
they are under `~/.cache/ridgeline/converted/<key>`, where the key hashes
the source files' digests and the converter's version, so a second start
with the same files converts nothing, and a changed file converts again.
Digests are sha256, so the same files converted from a directory or from the
Hub cache share one copy: a large file in the Hugging Face cache is a link to
a blob named by its sha256, read from the name; any other file is hashed
once and its digest kept (by path, size and modification time) in
`converted/digests.json`.
Conversion writes into a temporary directory renamed into place at the end:
an interrupted conversion leaves nothing that looks finished, and processes
converting the same source at once (several hosts on a shared disk) end with
one copy.

Everything wrong with `MODEL` is a `ModelSourceError` (a `ValueError`), one
line naming the problem and what to do: the server refuses the start with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Optional

log = logging.getLogger(__name__)

RIDGELINE_CONFIG = "model_config.json"  # model.checkpoint.CONFIG_FILE
HF_CONFIG = "config.json"
# Bump when a conversion of the same files would come out different: older converted copies are then unused.
CONVERTER_VERSION = "1"
# Files a conversion never reads (other weight formats, docs); every other top-level file goes into the key.
_NOT_READ = (".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".md", ".gitattributes", ".ckpt")
# What a download fetches: the config, safetensors weights, tokenizer and processor files, templates.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name (a bare name is taken for a missing path)
_HASH_CHUNK = 16 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")  # small files' blobs are named by their git sha1 instead: hashed here


class ModelSourceError(ValueError):
    """`MODEL` cannot be served; the message names the problem and what to do."""


class ModelNotFoundError(ModelSourceError, FileNotFoundError):
    """`MODEL` is neither an existing path nor a Hub id (also a FileNotFoundError, as a missing checkpoint
    directory was before Hub ids were taken)."""


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    checkpoint: str  # a Ridgeline checkpoint directory
    name: str  # the model name clients send by default (vLLM's: the MODEL argument; a directory's base name)
    source: str  # what MODEL named, for the log


def resolve(model: str, compilation_cache_dir: Optional[str] = None) -> ResolvedModel:
    """The Ridgeline checkpoint `model` names, converting (or finding the converted copy of) a Hugging Face
    checkpoint; `compilation_cache_dir` is `LLM`'s option of that name, whose directory the converted
    copies sit beside."""
    return checkpoint_of(resolve_source(model), compilation_cache_dir)


def resolve_source(model: str) -> ResolvedModel:
    """The directory `model` names as it is (a Hub id: its snapshot), nothing converted: what `checkpoint_of`
    converts, or a checkpoint served in place (a pooling model, `serving.features.pooling_models`)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return ResolvedModel(path, os.path.basename(os.path.normpath(path)), path)
    if os.path.exists(path):
        raise ModelSourceError(f"{model} is a file, not a model directory: pass a Ridgeline or Hugging Face "
                               "checkpoint directory, or a Hugging Face Hub id (org/name)")
    if not _HUB_ID.match(model):
        raise ModelNotFoundError(f"no directory {model}: pass a Ridgeline or Hugging Face checkpoint directory, or a "
                               "Hugging Face Hub id (org/name)")
    snapshot = hub_snapshot(model)
    return ResolvedModel(snapshot, model, f"{model} ({snapshot})")


def checkpoint_of(source: ResolvedModel, compilation_cache_dir: Optional[str] = None) -> ResolvedModel:
    """The Ridgeline checkpoint of a resolved source directory: a Ridgeline checkpoint as it is; a Hugging Face
    one converted (or its converted copy found); anything else refused."""
    path, name, source = source.checkpoint, source.name, source.source
    if os.path.isfile(os.path.join(path, RIDGELINE_CONFIG)):
        return ResolvedModel(path, name, source)
    if os.path.isfile(os.path.join(path, HF_CONFIG)):
        return ResolvedModel(converted_checkpoint(path, converted_root(compilation_cache_dir)), name, source)
    raise ModelNotFoundError(f"{path} is neither a Ridgeline checkpoint ({RIDGELINE_CONFIG}) nor a Hugging Face "
                           f"checkpoint ({HF_CONFIG} and safetensors weights): pass a directory of one of those, "
                           "or a Hugging Face Hub id (org/name)")


# --- the Hugging Face Hub ------------------------------------------------------------------------------------


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` is set, read now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> str:
    """The Hugging Face cache directory, from the environment now: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    `$XDG_CACHE_HOME/huggingface/hub` (huggingface_hub's own order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hub_snapshot(repo_id: str) -> str:
    """The local snapshot directory of `repo_id`: from the cache, downloading what is missing unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    cache, offline = hub_cache_dir(), hub_offline()
    try:
        snapshot = snapshot_download(repo_id, cache_dir=cache, local_files_only=offline, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError:
        if offline:
            raise ModelSourceError(f"{repo_id} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
                                   f"download it first (hf download {repo_id}) or unset HF_HUB_OFFLINE") from None
        raise ModelSourceError(f"cannot download {repo_id} from the Hugging Face Hub and it is not in the cache "
                               f"({cache}): check the network, or download it where there is one") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"no model {repo_id} on the Hugging Face Hub (or it is private or gated: log in with "
                               "hf auth login, or set HF_TOKEN)") from None
    except (EntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelSourceError(f"cannot fetch {repo_id} from the Hugging Face Hub: "
                               f"{' '.join(str(e).split())[:300]}") from None
    if offline:
        log.info("HF_HUB_OFFLINE is set: %s comes from the Hugging Face cache, %s (nothing downloaded)", repo_id,
                 snapshot)
    else:
        log.info("%s: Hugging Face snapshot %s", repo_id, snapshot)
    return snapshot


# --- conversion, cached ---------------------------------------------------------------------------------------


def converted_root(compilation_cache_dir: Optional[str] = None) -> str:
    """`converted/` beside the compilation cache directory (its default place when that cache is off)."""
    from serving.compilation import compile_cache

    cache = compile_cache.resolve_cache_dir(compilation_cache_dir) or compile_cache.default_cache_dir()
    return os.path.join(os.path.dirname(os.path.abspath(cache)), "converted")


def source_files(hf_dir: str) -> list[str]:
    """The top-level files of `hf_dir` a conversion may read, sorted by name."""
    return sorted(n for n in os.listdir(hf_dir) if os.path.isfile(os.path.join(hf_dir, n))
                  and not n.startswith(".") and not n.endswith(_NOT_READ))


def conversion_key(hf_dir: str, root: str) -> str:
    """A digest of the converter's version and every source file's name and digest."""
    memo = _DigestMemo(os.path.join(root, "digests.json"))
    h = hashlib.sha256(f"ridgeline-convert-hf {CONVERTER_VERSION}\n".encode())
    for name in source_files(hf_dir):
        h.update(f"{name} {memo.digest(os.path.join(hf_dir, name))}\n".encode())
    memo.save()
    return h.hexdigest()[:32]


class _DigestMemo:
    """File digests by (real path, size, mtime), so that a second start does not hash gigabytes again."""

    def __init__(self, path: str):
        self.path, self.changed = path, False
        try:
            with open(path) as f:
                self.entries = json.load(f)
        except (OSError, ValueError):
            self.entries = {}

    def digest(self, path: str) -> str:
        real = os.path.realpath(path)
        if os.path.basename(os.path.dirname(real)) == "blobs" and _SHA256.match(os.path.basename(real)):
            return os.path.basename(real)  # the Hugging Face cache names a large (LFS) file's blob by its sha256
        st = os.stat(real)
        stamp = [st.st_size, st.st_mtime_ns]
        known = self.entries.get(real)
        if known and known[:2] == stamp:
            return known[2]
        h = hashlib.sha256()
        with open(real, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        self.entries[real], self.changed = stamp + [h.hexdigest()], True
        return h.hexdigest()

    def save(self) -> None:
        if not self.changed:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.entries, f)
            os.replace(tmp, self.path)
        except OSError as e:  # only costs a re-hash next time
            log.warning("cannot save file digests to %s: %s", self.path, e)


def converted_checkpoint(hf_dir: str, root: str) -> str:
    """The converted copy of the Hugging Face checkpoint `hf_dir` under `root`, converting it if there is none."""
    from model.convert_hf import ConversionError, convert

    hf_dir = os.path.abspath(hf_dir)
    key = conversion_key(hf_dir, root)
    out = os.path.join(root, key)
    if os.path.isfile(os.path.join(out, RIDGELINE_CONFIG)):
        log.info("Hugging Face checkpoint %s: converted copy found at %s (cached, nothing to convert)", hf_dir, out)
        return out
    log.info("converting Hugging Face checkpoint %s into %s", hf_dir, out)
    t0 = time.perf_counter()
    try:
        os.makedirs(root, exist_ok=True)
        work = tempfile.mkdtemp(prefix=f"{key}.", suffix=".partial", dir=root)
    except OSError as e:
        raise ModelSourceError(f"cannot write converted checkpoints to {root}: {e.strerror or e}; point "
                               "--compilation_cache_dir (beside which they go) somewhere writable") from None
    try:
        convert(hf_dir, os.path.join(work, "ckpt"), progress=False)
        try:
            os.rename(os.path.join(work, "ckpt"), out)
        except OSError:  # another process finished the same conversion first
            if not os.path.isfile(os.path.join(out, RIDGELINE_CONFIG)):
                raise
    except ConversionError as e:
        raise ModelSourceError(f"cannot convert the Hugging Face checkpoint {hf_dir}: {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("converted %s in %.1f s", hf_dir, time.perf_counter() - t0)
    return out
