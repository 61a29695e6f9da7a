"""Compiling the engine's programs: JAX's persistent cache, whole executables saved beside it, the one
table of compiled programs a process holds, and the warm-up that fills it. Below `serving/core`: it
knows programs by their keys and lowerings, not what the engine builds them from."""
