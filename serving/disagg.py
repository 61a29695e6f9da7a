"""Disaggregated prefill/decode: a prompt is prefilled on one server and decoded on another.

Contract (what a router relies on)
----------------------------------
Both roles are ordinary `python -m serving.server` processes; every server
mounts two internal routes next to the OpenAI API (`serving.http_app`), so any
worker can act as a prefill worker, a decode worker, or serve whole requests.

`POST /internal/prefill`, JSON `{"endpoint": "/v1/completions" | "/v1/chat/completions", "body": <the client's
OpenAI request>}`. The worker tokenizes the request as the endpoint would,
runs the prompt and samples the first token with the request's own sampling
parameters and seed (max_tokens is forced to 1 here; the client's value is
still checked against the context window). The answer is a binary KV payload
(`application/x-ridgeline-kv`), streamed:

    b"RKV1" | uint32 little-endian header length | header JSON (utf-8) | raw array bytes

The header holds `version`, `endpoint` and `body` (echoed, so the payload
alone is enough for the decode worker), `model` (served name), `num_layers`,
`num_kv_heads`, `head_dim`, `dtype`, `page_size` (of the prefill worker; the
receiver may use another), `num_tokens` (= prompt length), `prompt_token_ids`,
`first_token`, `seed` (the effective sampling seed), `logprobs` (the first
token's chosen logprob, rank, top ids and top logprobs, or null) and
`arrays`: the per-layer arrays, e.g. `[{"name": "k", "shape": [num_tokens,
kv_heads, head_dim]}, {"name": "v", ...}]`. The body is, for each layer in
order, each listed array's C-order bytes, so for plain K/V it is one
`[layers, 2, num_tokens, kv_heads, head_dim]` array. Quantized caches add
arrays (e.g. `k_scale`, `v_scale`) to the list without changing the framing;
a worker refuses arrays it does not know with a 400. Response headers:
`x-ridgeline-kv-bytes` (body bytes after the header) and
`x-ridgeline-prefill-seconds`.

`POST /internal/decode`, body = that payload, unchanged. The worker checks it
(framing, sizes, model geometry and dtype against its own cache, the prompt
the body tokenizes to against `prompt_token_ids`), then serves the echoed
`endpoint`/`body` exactly as it would serve the request itself (the same
handler, so JSON or SSE streaming with the same shape), except that the
prompt's K/V comes from the payload: blocks are allocated through the block
manager (cached prefix blocks are reused, the rest written by one jitted
scatter into the donated cache), full blocks are registered in the prefix
cache so later turns hit, and generation continues from the shipped first
token. Bad payloads or mismatched models get an OpenAI-style error with a
4xx status and hold no blocks. Only single-prompt requests with n == 1,
without echo or prompt logprobs, can be disaggregated (400 otherwise).

`run_disaggregated(client, prefill_url, decode_url, endpoint, body)` is the
router's side: it pipes the prefill worker's payload into the decode request
as it arrives (no full buffering in the router) and returns the decode
worker's streaming `httpx.Response` (the caller reads or relays it and closes
it) and a `KVTransferRecord` (bytes, tokens and seconds).

Transport and overlap
---------------------
The workers are independent single-process JAX programs, so JAX's
cross-process transfers (which need one distributed runtime) do not apply:
KV is staged through host memory and sent over HTTP. On the prefill worker
the request's pages are gathered on device by one jitted gather and copied
to host once, off the engine thread; the payload is streamed layer by layer,
and the router forwards each chunk to the decode worker as it arrives, so the
two hops overlap. Chunked prefill of a long prompt does not ship pages early
(the export happens when the first token is sampled); see docs/serving.md.
"""
