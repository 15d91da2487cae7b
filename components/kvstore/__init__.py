"""KV handoff from the AR step to the DiT step: payload format, store interface, backends.

`open_store(url)` picks the backend: `local:///dir` (default, embedded) or
`mooncake://MASTER:PORT?metadata=...` (needs the mooncake wheel, imported only then).
"""

from components.kvstore.base import (
    GetResult,
    Health,
    KVStore,
    StoreError,
    check_key,
    make_key,
    open_store,
)
from components.kvstore.payload import (
    PayloadError,
    decode_payload,
    encode_into,
    encode_payload,
    payload_size,
    read_header,
)

__all__ = [
    "GetResult",
    "Health",
    "KVStore",
    "PayloadError",
    "StoreError",
    "check_key",
    "decode_payload",
    "encode_into",
    "encode_payload",
    "make_key",
    "open_store",
    "payload_size",
    "read_header",
]
