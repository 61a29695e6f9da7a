"""Checks run from a checkout (`python -m tools.import_graph`). Not installed: pyproject.toml's
package list names only model, sharding, serving, kernels_pallas and configs."""
