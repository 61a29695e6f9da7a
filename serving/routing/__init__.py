"""The router's parts (jax-free): the prefix index and policies, worker health, router metrics.

Nothing is imported here: importing a module of the package imports only what it needs."""
