"""Speculative decoding: draft proposers (a small draft model, prompt lookup), verification of
k + 1 positions per sequence inside the engine's ragged step, and distribution-exact acceptance."""

from serving.spec_decode.decoder import SpecDecoder, SpecStats, compilation_count
from serving.spec_decode.options import METHODS, check_options, default_draft_dir, logit_rows

__all__ = ["METHODS", "SpecDecoder", "SpecStats", "check_options", "compilation_count", "default_draft_dir", "logit_rows"]
