"""`open_store(url)`: the backend for a store URL (kept apart from base.py, which the backends import)."""

from __future__ import annotations

from urllib.parse import unquote

from components.kvstore.base import KVStore, parse_query


def open_store(url: str | None = None) -> KVStore:
    """`local:///dir[?ttl=24h]` or a plain path -> LocalStore; `mooncake://HOST:PORT?...` -> MooncakeStore."""
    if not url:
        raise ValueError("store url is empty (use local:///path or mooncake://host:port?metadata=...)")
    if url.startswith("mooncake://"):
        from components.kvstore.mooncake import MooncakeStore  # lazy: needs the mooncake wheel

        return MooncakeStore.from_url(url)
    if url.startswith("local://"):
        u, q = parse_query(url)
        if set(q) - {"ttl"}:
            raise ValueError(f"store url {url!r}: local:// takes only ttl (e.g. ?ttl=12h), got {sorted(q)}")
        path = unquote(u.netloc + u.path)
        if "ttl" in q:
            from components.kvstore.base import parse_duration
            from components.kvstore.local import LocalStore

            return LocalStore(path, parse_duration(q["ttl"], "local store ttl"))
    elif "://" in url:
        raise ValueError(f"store url {url!r}: unknown scheme (use local:// or mooncake://)")
    else:
        path = url
    from components.kvstore.local import LocalStore

    return LocalStore(path)
