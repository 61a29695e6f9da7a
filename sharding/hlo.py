"""Reading collectives out of compiled HLO text.

The forward pass names each layer's ops with `jax.named_scope("layer_<i>")`,
which survives into the compiled HLO as `metadata={op_name=".../layer_3/..."}`.
That lets a test or `sharding.plan --measure` count the collectives XLA
actually inserted, per layer, instead of trusting the layout on paper.
Asynchronous pairs (`all-reduce-start` / `-done`) count once, as their start.
"""

from __future__ import annotations

import collections
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# `%name = f32[16,64]{1,0} all-reduce(...)` or a tuple-shaped async start.
_OP = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|\S+)\s+(?P<kind>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\("
)
_LAYER = re.compile(r'op_name="[^"]*?\blayer_(\d+)/')


def collectives(hlo_text: str) -> list[dict]:
    """Every collective op: {"kind", "shape", "layer" (int or None)}."""
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        layer = _LAYER.search(line)
        found.append({"kind": m.group("kind"), "shape": m.group("shape"),
                      "layer": int(layer.group(1)) if layer else None})
    return found


def collective_counts(hlo_text: str) -> dict[str, int]:
    return dict(collections.Counter(c["kind"] for c in collectives(hlo_text)))


def collectives_per_layer(hlo_text: str) -> dict:
    """{layer index: {kind: count}} plus key "outside" for ops in no layer (embedding, logits)."""
    out: dict = collections.defaultdict(collections.Counter)
    for c in collectives(hlo_text):
        out["outside" if c["layer"] is None else c["layer"]][c["kind"]] += 1
    return {k: dict(v) for k, v in out.items()}


def shape_dims(shape: str) -> tuple[int, ...] | None:
    """`f32[16,64]{1,0}` -> (16, 64); None for tuples."""
    m = re.fullmatch(r"[a-z0-9]+\[([0-9,]*)\](\{[^}]*\})?", shape)
    if not m:
        return None
    return tuple(int(x) for x in m.group(1).split(",") if x)
