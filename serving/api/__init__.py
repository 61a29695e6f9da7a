"""The OpenAI-compatible API over HTTP: the app, its protocol types, API keys, metrics, chat templates, profiling.

Nothing is imported here: importing a module of the package imports only what it needs."""
