"""Block hashes that chain over token ids: equal prefixes give equal hashes on every replica.

A block's hash is the first 8 bytes (a signed 64-bit integer, as routers keep them) of the
BLAKE2b digest of its parent's hash, the salt (the adapter and frequency set its KV was computed
under) and its token ids as little-endian 32-bit integers. Nothing depends on the process
(Python's `hash` is salted per process), the page ids or the order pages were cached in.
"""

from __future__ import annotations

import hashlib

import numpy as np

NO_PARENT = bytes(8)  # the parent of a sequence's first block


def salt_of(lora_name: str | None, long_rope: bool) -> bytes:
    """What sets KV apart besides its tokens: the adapter's name and LongRoPE's long
    frequencies (the base model's short-frequency KV: no salt)."""
    salt = b""
    if lora_name is not None:
        salt += b"lora:" + lora_name.encode() + b"\0"
    if long_rope:
        salt += b"long_rope\0"
    return salt


def chain_hashes(parent: int | None, tokens: list[int], block_size: int, salt: bytes) -> list[int]:
    """The hashes of the blocks of `tokens` (whole blocks of `block_size`) following the block
    hashed `parent` (None: the sequence's first block)."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * block_size
    previous = NO_PARENT if parent is None else parent.to_bytes(8, "big", signed=True)
    hashes = []
    for start in range(0, len(data), step):
        previous = hashlib.blake2b(previous + salt + data[start:start + step],
                                   digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "big", signed=True))
    return hashes
