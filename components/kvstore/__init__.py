"""KV handoff from the AR step to the DiT step: payload format, store interface, backends.

`open_store(url)` picks the backend: `local:///dir` (default, embedded) or
`mooncake://MASTER:PORT?metadata=...` (needs the mooncake wheel, imported only then).

Names are imported on first use, so `import components.kvstore` (the `ardit` CLI) does not
import torch; `from components.kvstore import open_store` works as usual.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "GetResult": "base", "Health": "base", "KVStore": "base", "StoreError": "base", "check_key": "base",
    "make_key": "base", "open_store": "factory", "PayloadError": "payload", "decode_payload": "payload",
    "encode_into": "payload", "encode_payload": "payload", "payload_size": "payload", "read_header": "payload",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
