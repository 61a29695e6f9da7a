"""The signed, size-bounded wire format of a KV payload (no jax: it is plain bytes and HMAC).

A payload carries a prompt's K/V from a prefill worker to a decode worker,
which registers its pages in a prefix cache every later request may hit, so a
forged one would change what other users get back. Every payload is
therefore signed with HMAC-SHA256 under a secret the workers share
(`--kv_transfer_secret`), and read under caps so that no body can make the
receiver buffer more than its KV pool could hold:

    b"RKV2" | u32 LE header length | header JSON | header tag (32) | array bytes | payload tag (32)

The header tag authenticates the framing and header, so the receiver can trust
the sizes the header announces before it reads the body; the payload tag
authenticates everything before it. Each is an HMAC under its own key derived
from the secret, so neither can stand in for the other. The receiver checks a
tag (in constant time) before it parses what the tag covers: the header JSON
only after the header tag, the arrays only after the payload tag.

`PayloadSigner` writes a payload piece by piece (the sender streams it layer
by layer); `read_payload` reads one from an async byte stream and
`read_payload_bytes` from bytes. Failures raise `WireError` with the HTTP
status a route answers: 401 for a payload without its tags (an unsigned
`RKV1` payload, or one cut off before a tag), 403 for a wrong tag, 413 for a
header or body larger than allowed, 400 for malformed framing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import AsyncIterator, Callable, Union

MAGIC = b"RKV2"
UNSIGNED_MAGIC = b"RKV1"  # the unsigned format that came before
TAG_BYTES = 32
PREFIX_BYTES = 8  # magic + u32 header length


class WireError(ValueError):
    """A payload this worker will not read; `status` is the HTTP answer, `code` the OpenAI error code."""

    param = "payload"

    def __init__(self, message: str, status: int = 400, code: str = "invalid_kv_payload"):
        super().__init__(message)
        self.status, self.code = status, code


class SigningKeys:
    """The two HMAC keys derived from the shared secret: one for headers, one for whole payloads."""

    def __init__(self, secret: Union[str, bytes]):
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        if not secret:
            raise ValueError("the KV transfer secret must not be empty")
        self.header_key = hmac.new(secret, b"ridgeline kv payload header", hashlib.sha256).digest()
        self.payload_key = hmac.new(secret, b"ridgeline kv payload body", hashlib.sha256).digest()

    def header_tag(self, framed_header: bytes) -> bytes:
        return hmac.new(self.header_key, framed_header, hashlib.sha256).digest()

    def payload_mac(self):
        return hmac.new(self.payload_key, digestmod=hashlib.sha256)


class PayloadSigner:
    """Writes one signed payload: `head()` first, then `body(chunk)` for each piece, then `tail()`."""

    def __init__(self, keys: SigningKeys, header: dict):
        blob = json.dumps(header).encode("utf-8")
        framed = MAGIC + struct.pack("<I", len(blob)) + blob
        self._head = framed + keys.header_tag(framed)
        self._mac = keys.payload_mac()
        self._mac.update(self._head)

    def head(self) -> bytes:
        return self._head

    def body(self, chunk: bytes) -> bytes:
        self._mac.update(chunk)
        return chunk

    def tail(self) -> bytes:
        return self._mac.digest()


def sign_payload(keys: SigningKeys, header: dict, body: bytes) -> bytes:
    """A whole signed payload in memory."""
    signer = PayloadSigner(keys, header)
    return signer.head() + signer.body(body) + signer.tail()


class _Stream:
    """Reads exact byte counts from an async iterator of chunks, never holding more than asked for plus
    one chunk."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        self._chunks = chunks.__aiter__()
        self._buf = bytearray()
        self.ended = False

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n and not self.ended:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self.ended = True
                return
            self._buf += chunk

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes (fewer only at the end of the stream)."""
        await self._fill(n)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def read_into(self, out: bytearray, mac) -> int:
        """Fills `out` from the stream, feeding `mac` as it goes; returns how many bytes it got.

        Bytes are copied into `out` chunk by chunk, so at most one chunk is held besides it.
        """
        view, got = memoryview(out), 0
        while got < len(out):
            if not self._buf:
                await self._fill(1)
                if not self._buf:
                    return got
            n = min(len(self._buf), len(out) - got)
            with memoryview(self._buf) as buffered:  # no copies but the one into `out`
                view[got:got + n] = buffered[:n]
                mac.update(view[got:got + n])
            del self._buf[:n]
            got += n
        return got

    async def at_end(self) -> bool:
        await self._fill(1)
        return not self._buf


async def read_payload(chunks: AsyncIterator[bytes], keys: SigningKeys, max_header_bytes: int,
                       body_bytes_for: Callable[[dict], int]) -> tuple[dict, memoryview]:
    """(header, array bytes) of a signed payload read from `chunks`.

    `body_bytes_for(header)` is called once the header is authenticated; it checks the header
    against this worker (raising `WireError`, or any ValueError, for one it cannot hold) and
    returns how many array bytes must follow. Nothing beyond `max_header_bytes` of header and
    that many array bytes (plus the tags) is ever buffered: a longer payload is refused with
    413 as soon as its first extra byte arrives.
    """
    stream = _Stream(chunks)
    prefix = await stream.read(PREFIX_BYTES)
    if prefix[:4] == UNSIGNED_MAGIC:
        raise WireError("unsigned KV payload (format RKV1): this worker accepts only payloads signed with the "
                        "shared --kv_transfer_secret", status=401, code="kv_payload_unsigned")
    if len(prefix) < PREFIX_BYTES or prefix[:4] != MAGIC:
        raise WireError("not a KV payload (bad magic)")
    (n,) = struct.unpack("<I", prefix[4:])
    if n > max_header_bytes:
        raise WireError(f"KV payload header of {n} bytes exceeds this worker's limit of {max_header_bytes}",
                        status=413, code="kv_payload_too_large")
    blob = await stream.read(n)
    if len(blob) < n:
        raise WireError(f"KV payload truncated inside its header ({len(blob)} of {n} bytes)")
    tag = await stream.read(TAG_BYTES)
    if len(tag) < TAG_BYTES:
        raise WireError("KV payload has no header signature", status=401, code="kv_payload_unsigned")
    if not hmac.compare_digest(tag, keys.header_tag(prefix + blob)):
        raise WireError("KV payload header signature does not match (not signed with this worker's "
                        "--kv_transfer_secret)", status=403, code="kv_payload_forged")
    try:
        header = json.loads(blob)
    except ValueError as e:
        raise WireError(f"KV payload header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WireError("KV payload header is not a JSON object")
    size = body_bytes_for(header)
    mac = keys.payload_mac()
    mac.update(prefix + blob + tag)
    body = bytearray(size)
    got = await stream.read_into(body, mac)
    if got < size:
        raise WireError(f"KV payload carries {got} bytes of K/V, expected {size}")
    tail = await stream.read(TAG_BYTES)
    if len(tail) < TAG_BYTES:
        raise WireError("KV payload has no signature after its arrays", status=401, code="kv_payload_unsigned")
    if not await stream.at_end():
        raise WireError(f"KV payload is longer than the {size} bytes of K/V its header announces", status=413,
                        code="kv_payload_too_large")
    if not hmac.compare_digest(tail, mac.digest()):
        raise WireError("KV payload signature does not match (its arrays were changed, or it was not signed "
                        "with this worker's --kv_transfer_secret)", status=403, code="kv_payload_forged")
    return header, memoryview(body)


async def _one(data: bytes):
    yield bytes(data)


def read_payload_bytes(data: bytes, keys: SigningKeys, max_header_bytes: int,
                       body_bytes_for: Callable[[dict], int]) -> tuple[dict, memoryview]:
    """`read_payload` over bytes already in memory (tests, benchmarks)."""
    import asyncio

    return asyncio.run(read_payload(_one(data), keys, max_header_bytes, body_bytes_for))
