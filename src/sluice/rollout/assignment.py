"""Sticky assignment of streams to versions by a stable hash of a routing key.

A routing key (the request's ``user``, an ``X-Sluice-Routing-Key`` header, else the API
key's tenant) hashes, with the alias's name, to one of :data:`NUM_BUCKETS` buckets. The
canary serves the buckets below its weight (``weight`` percent of them) and the stable
version the rest. A weight change therefore moves only the keys whose bucket lies between
the old and the new weight: raising the canary from 5 to 25 moves buckets [5 %, 25 %) to
it and nobody off it; a rollback to 0 moves every canary key to stable and nobody else.
The hash is BLAKE2b, so a key lands in the same bucket in every process and after every
restart (Python's ``hash()`` is salted per process).

A request with no key at all (an anonymous caller that names no user) is assigned at
random with the same weights: it has no conversation to keep on one version.
"""

from __future__ import annotations

import hashlib
import random
from typing import Final

__all__ = ["NUM_BUCKETS", "bucket_of", "in_canary"]

# Buckets of the key space: weights resolve to 0.01 percent.
NUM_BUCKETS: Final = 10_000
# Keys longer than this are cut before hashing (a header or field is bounded already).
_MAX_KEY_CHARS = 1024


def bucket_of(alias: str, key: str) -> int:
    """The bucket of ``key`` under ``alias``, in ``[0, NUM_BUCKETS)``; the same everywhere."""
    material = f"{alias}\0{key[:_MAX_KEY_CHARS]}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(material, digest_size=8, person=b"sluice-rollout").digest()
    return int.from_bytes(digest, "big") % NUM_BUCKETS


def in_canary(alias: str, key: str | None, canary_weight: float, rng: random.Random) -> bool:
    """Whether a stream with routing ``key`` goes to the canary at ``canary_weight`` percent.

    ``rng`` draws for keyless streams only.
    """
    if canary_weight <= 0:
        return False
    if canary_weight >= 100:
        return True
    cut = round(canary_weight * NUM_BUCKETS / 100)
    bucket = rng.randrange(NUM_BUCKETS) if key is None else bucket_of(alias, key)
    return bucket < cut
