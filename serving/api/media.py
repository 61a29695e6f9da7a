"""Images a chat request carries: OpenAI `image_url` content parts, decoded off the event loop.

A part's URL is a `data:` URL (base64 PNG, JPEG or WebP, decoded here) or an `http(s)` URL, which is
fetched only when its host is one of `--allowed_media_domains` (exact host names; none by default, so a
server never fetches unless told to: a fetch on a client's behalf is a server-side request forgery
hole otherwise). A fetch has a byte cap and a timeout, and follows a redirect only to the same host (a
redirect is how an allowed host would send the server somewhere else). Decoding checks the format and
the pixel count before decoding the pixels (a small file can declare a huge image).

The work runs in a bounded pool of worker threads (`MediaLoader`): decoding and fetching never block
the HTTP event loop, and at most `workers` images are worked on at once, the rest waiting their turn.
Every failure is an `APIError` 400 naming the content part (`messages[1].content[2]`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import io
import urllib.parse

import httpx
from PIL import Image, UnidentifiedImageError

from serving.api import http_protocol as P

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_REDIRECTS = 3


@dataclasses.dataclass(frozen=True)
class MediaOptions:
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name; empty: no fetching
    max_bytes: int = 20 << 20  # an image's encoded size, however it arrives
    max_pixels: int = 40_000_000  # width x height as the file declares it
    fetch_timeout_s: float = 10.0
    workers: int = 4


class MediaError(ValueError):
    """An image part cannot be used; the message says why (the caller names the part)."""


def decode_image(data: bytes, options: MediaOptions) -> Image.Image:
    """The decoded image of an encoded PNG / JPEG / WebP file."""
    if len(data) > options.max_bytes:
        raise MediaError(f"the image is {len(data)} bytes; the limit is {options.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise MediaError(f"not a decodable image (supported: {', '.join(FORMATS)})") from None
    if image.width * image.height > options.max_pixels:
        raise MediaError(f"the image is {image.width}x{image.height} pixels; the limit is {options.max_pixels} pixels")
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"the image data is broken: {e}") from None
    return image


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 `data:` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise MediaError("a data: URL needs the form data:image/png;base64,<data>")
    media_type, *params = head[5:].split(";")
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"a data: URL of type {media_type!r} is not an image")
    if "base64" not in params:
        raise MediaError("only base64 data: URLs are supported")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URL is not valid base64") from None


def _host(url: str) -> str:
    return (urllib.parse.urlsplit(url).hostname or "").lower()


def fetch(url: str, options: MediaOptions, client: httpx.Client | None = None) -> bytes:
    """The body of an http(s) URL on an allowed host: at most `max_bytes`, redirects only to the same host."""
    scheme, host = urllib.parse.urlsplit(url).scheme.lower(), _host(url)
    if scheme not in ("http", "https"):
        raise MediaError(f"unsupported URL scheme {scheme!r}: use a data: URL or http(s)")
    if host not in options.allowed_domains:
        raise MediaError(f"fetching images from {host!r} is not allowed (allowed hosts: "
                         f"{', '.join(options.allowed_domains) or 'none; the server takes data: URLs only'})")
    own = client is None
    client = client or httpx.Client(follow_redirects=False, timeout=options.fetch_timeout_s)
    try:
        for _ in range(MAX_REDIRECTS + 1):
            with client.stream("GET", url) as response:
                if response.is_redirect:
                    target = urllib.parse.urljoin(url, response.headers.get("location", ""))
                    if _host(target) != host or urllib.parse.urlsplit(target).scheme.lower() not in ("http", "https"):
                        raise MediaError(f"the image URL redirects to another host ({_host(target)!r}); "
                                         "only same-host redirects are followed")
                    url = target
                    continue
                if response.status_code != 200:
                    raise MediaError(f"fetching the image returned HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > options.max_bytes:
                    raise MediaError(f"the image is {declared} bytes; the limit is {options.max_bytes}")
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > options.max_bytes:
                        raise MediaError(f"the image is over the limit of {options.max_bytes} bytes")
                return bytes(body)
        raise MediaError(f"the image URL redirects more than {MAX_REDIRECTS} times")
    except httpx.TimeoutException:
        raise MediaError(f"fetching the image took longer than {options.fetch_timeout_s} s") from None
    except httpx.HTTPError as e:
        raise MediaError(f"fetching the image failed: {type(e).__name__}") from None
    finally:
        if own:
            client.close()


def load_image(url: str, options: MediaOptions) -> Image.Image:
    data = data_url_bytes(url) if url.startswith("data:") else fetch(url, options)
    return decode_image(data, options)


class MediaLoader:
    """Loads a request's image parts in a fixed pool of worker threads."""

    def __init__(self, options: MediaOptions = MediaOptions()):
        self.options = options
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=options.workers,
                                                           thread_name_prefix="media")

    async def load(self, parts: list[tuple[str, str]]) -> list[Image.Image]:
        """The images of `parts` ((name, url) in prompt order); an `APIError` naming the first bad part."""
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._pool, load_image, url, self.options) for _, url in parts]
        results = await asyncio.gather(*futures, return_exceptions=True)
        for (name, _), result in zip(parts, results):
            if isinstance(result, MediaError):
                raise P.APIError(f"{name}: {result}", param=name, code="invalid_value")
            if isinstance(result, BaseException):
                raise result
        return results

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
