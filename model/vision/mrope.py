"""Multimodal rotary positions (Qwen2-VL's M-RoPE): every token has a (temporal, height, width)
position; the rotary frequencies are split into three sections (`LlamaConfig.mrope_section`), each
rotated by one of the three.

Text tokens have all three equal and count up by one. An image's tokens share the temporal position
of the image's start and take their row and column in the merged grid, added to it; the text after
the image continues from the start plus the larger of the grid's height and width (in tokens). So a
prompt's positions run ahead of (or behind) its token count by a fixed `delta`, and every token
generated after the prompt is at (index + delta) on all three axes.

`prompt_positions` computes this on the host from the token ids and the images' grids; a chunk of
prefill or a decode step then slices it (or adds `delta`), so positions continue correctly whatever
the chunking.
"""

from __future__ import annotations

import numpy as np


def prompt_positions(tokens, image_token_id: int, grids, merge_size: int) -> tuple[np.ndarray, int]:
    """([3, len(tokens)] int32 positions, delta) of a prompt whose runs of `image_token_id` hold the
    images of `grids` ((t, h, w) in patches, in prompt order), each `t*h*w / merge^2` tokens long."""
    tokens = np.asarray(tokens)
    n = len(tokens)
    out = np.zeros((3, n), np.int64)
    grids = list(grids)
    i = pos = image = 0
    while i < n:
        if tokens[i] != image_token_id:
            j = i
            while j < n and tokens[j] != image_token_id:
                j += 1
            out[:, i:j] = pos + np.arange(j - i)
            pos += j - i
            i = j
            continue
        if image >= len(grids):
            raise ValueError(f"the prompt has more image placeholder runs than the {len(grids)} images given")
        t, h, w = (int(x) for x in grids[image])
        gh, gw = h // merge_size, w // merge_size
        count = t * gh * gw
        if i + count > n or np.any(tokens[i:i + count] != image_token_id):
            raise ValueError(f"image {image} needs {count} consecutive placeholder tokens at position {i}")
        out[0, i:i + count] = pos + np.repeat(np.arange(t), gh * gw)
        out[1, i:i + count] = pos + np.tile(np.repeat(np.arange(gh), gw), t)
        out[2, i:i + count] = pos + np.tile(np.arange(gw), t * gh)
        pos += max(gh, gw)
        i += count
        image += 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} images given but the prompt has placeholders for {image}")
    delta = int(out.max()) + 1 - n if n else 0
    return out.astype(np.int32), delta


def positions_for(prompt: np.ndarray, delta: int, start: int, count: int) -> np.ndarray:
    """[3, count] positions of the tokens `start .. start+count` of a sequence whose prompt's positions
    are `prompt` ([3, P]): the prompt's own where they fall inside it, (index + delta) past it."""
    idx = np.arange(start, start + count)
    inside = idx < prompt.shape[1]
    out = np.broadcast_to(idx + delta, (3, count)).copy()
    out[:, inside] = prompt[:, idx[inside]]
    return out.astype(np.int32)
