"""`open_store(url)`: the backend for a store URL (kept apart from base.py, which the backends import)."""

from __future__ import annotations

from urllib.parse import unquote

from components.kvstore.base import KVStore, parse_query


def open_store(url: str | None = None) -> KVStore:
    """`local:///dir` or a plain path -> LocalStore; `mooncake://HOST:PORT?...` -> MooncakeStore."""
    if not url:
        raise ValueError("store url is empty (use local:///path or mooncake://host:port?metadata=...)")
    if url.startswith("mooncake://"):
        from components.kvstore.mooncake import MooncakeStore  # lazy: needs the mooncake wheel

        return MooncakeStore.from_url(url)
    if url.startswith("local://"):
        u, q = parse_query(url)
        if q:
            raise ValueError(f"store url {url!r}: local:// takes no parameters, got {sorted(q)}")
        path = unquote(u.netloc + u.path)
    elif "://" in url:
        raise ValueError(f"store url {url!r}: unknown scheme (use local:// or mooncake://)")
    else:
        path = url
    from components.kvstore.local import LocalStore

    return LocalStore(path)
