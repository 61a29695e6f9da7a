"""Several processes: joining jax.distributed, process 0 announcing device calls, local fleets of servers.

Nothing is imported here: importing a module of the package imports only what it needs."""
