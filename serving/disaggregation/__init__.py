"""Disaggregated prefill/decode: the KV export/import, the signed wire format, the HTTP routes.

Nothing is imported here: importing a module of the package imports only what it needs."""
