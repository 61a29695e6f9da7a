"""The signed KV payload format: every tampering is refused before what it touched is parsed, and no
payload makes the reader buffer more than its header may announce."""

import asyncio
import json
import struct

import numpy as np
import pytest

from serving.disaggregation import kv_wire

KEYS = kv_wire.SigningKeys("shared secret")
HEADER = {"version": 2, "num_tokens": 3, "model": "m"}
BODY = np.random.default_rng(0).standard_normal(96).astype(np.float32).tobytes()


def body_size(header):
    return header["num_tokens"] * 128


def read(data, keys=KEYS, max_header=4096, size=body_size):
    return kv_wire.read_payload_bytes(data, keys, max_header, size)


def refused(data, status, **kw):
    with pytest.raises(kv_wire.WireError) as e:
        read(data, **kw)
    assert e.value.status == status, (e.value.status, str(e.value))
    return e.value


def framed(header: dict) -> bytes:
    blob = json.dumps(header).encode()
    return kv_wire.MAGIC + struct.pack("<I", len(blob)) + blob


def test_a_signed_payload_reads_back_and_streams_the_same_bytes():
    whole = kv_wire.sign_payload(KEYS, HEADER, BODY)
    header, body = read(whole)
    assert header == HEADER and bytes(body) == BODY
    signer = kv_wire.PayloadSigner(KEYS, HEADER)  # piece by piece, as the prefill route streams it
    assert signer.head() + signer.body(BODY[:100]) + signer.body(BODY[100:]) + signer.tail() == whole
    # Read from a stream cut anywhere, the same payload comes out.

    async def chunks(step):
        for i in range(0, len(whole), step):
            yield whole[i:i + step]

    for step in (1, 7, 64, 10_000):
        h, b = asyncio.run(kv_wire.read_payload(chunks(step), KEYS, 4096, body_size))
        assert h == HEADER and bytes(b) == BODY


def test_changed_bytes_anywhere_are_forged():
    whole = kv_wire.sign_payload(KEYS, HEADER, BODY)
    head_len = 8 + struct.unpack("<I", whole[4:8])[0]
    for pos in (10, head_len + 3, head_len + kv_wire.TAG_BYTES + 5, len(whole) - 40, len(whole) - 1):
        forged = bytearray(whole)
        forged[pos] ^= 0x01
        refused(bytes(forged), 403)
    # Random K/V in a payload whose header is genuine (the cache-poisoning attack).
    body_at = head_len + kv_wire.TAG_BYTES
    noise = np.random.default_rng(1).standard_normal(len(BODY) // 4).astype(np.float32).tobytes()
    refused(whole[:body_at] + noise + whole[body_at + len(BODY):], 403)
    # Signed under another secret.
    refused(kv_wire.sign_payload(kv_wire.SigningKeys("guessed"), HEADER, BODY), 403)
    # The header's tag does not stand in for the payload's.
    tag = whole[head_len:body_at]
    refused(whole[:body_at] + BODY + tag, 403)


def test_a_header_is_parsed_only_once_its_tag_checks_out():
    seen = []

    def size(header):
        seen.append(header)
        return body_size(header)

    whole = kv_wire.sign_payload(KEYS, HEADER, BODY)
    head_len = 8 + struct.unpack("<I", whole[4:8])[0]
    bigger = framed({**HEADER, "num_tokens": 10**9})  # announces a huge body, with the old tag
    refused(bigger + whole[head_len:], 403, size=size)
    refused(framed(HEADER) + b"\0" * 32 + BODY, 403, size=size)
    assert seen == []  # the sizes a forged header announces were never looked at
    read(whole, size=size)
    assert seen == [HEADER]


def test_unsigned_truncated_and_malformed_payloads():
    whole = kv_wire.sign_payload(KEYS, HEADER, BODY)
    head_len = 8 + struct.unpack("<I", whole[4:8])[0]
    unsigned = b"RKV1" + whole[4:head_len] + BODY  # the format before payloads were signed
    assert "unsigned" in str(refused(unsigned, 401))
    refused(whole[:head_len + 10], 401)  # cut inside the header tag
    refused(whole[:-5], 401)  # cut inside the payload tag
    refused(whole[:head_len + kv_wire.TAG_BYTES + 50], 400)  # cut inside the arrays
    refused(whole[:head_len - 3], 400)  # cut inside the header
    refused(b"GET / HTTP/1.1", 400)
    refused(b"", 400)
    blob = b"[1, 2]"
    prefix = kv_wire.MAGIC + struct.pack("<I", len(blob)) + blob
    refused(prefix + KEYS.header_tag(prefix), 400)  # signed, but not an object


def test_oversized_headers_and_bodies_are_413_and_never_buffered():
    refused(kv_wire.MAGIC + struct.pack("<I", 5000) + b"{}", 413)
    whole = kv_wire.sign_payload(KEYS, HEADER, BODY)
    refused(whole + b"x", 413)  # a byte more than the header announces

    pulled = []

    async def endless():  # a signed header, its body, then far more than announced
        pulled.append(len(whole))
        yield whole
        for _ in range(10_000):
            pulled.append(1 << 16)
            yield b"\0" * (1 << 16)

    with pytest.raises(kv_wire.WireError) as e:
        asyncio.run(kv_wire.read_payload(endless(), KEYS, 4096, body_size))
    assert e.value.status == 413
    assert sum(pulled) <= len(whole) + (1 << 16)  # stopped at the first chunk past the payload


def test_an_empty_secret_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        kv_wire.SigningKeys("")
