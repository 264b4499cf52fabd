"""The hash chain that names full blocks for prefix reuse.

A full block's hash is blake2b(parent hash || its tokens), where the parent is the hash of
the block before it, and the first block's parent is the root hash of the cache's
namespace (the LoRA adapter its K and V were computed with, or none). A block's hash thus
names its whole prefix: equal hashes mean equal token prefixes computed by the same
adapter. Lookups still compare the parent and the tokens (BlockAllocator.lookup), so a
collision cannot hand out the wrong K and V.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def root_hash(namespace: str) -> bytes:
    """The parent of a cache's first block; distinct namespaces never share blocks."""
    return hashlib.blake2b(b"modelexec-prefix\0" + namespace.encode(), digest_size=DIGEST_BYTES).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=DIGEST_BYTES).digest()
