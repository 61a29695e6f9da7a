"""The engine core: requests, scheduling over the paged KV pool, the model runners, sampling and outputs.

Nothing is imported here: importing a module of the package imports only what it needs."""
