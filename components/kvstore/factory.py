"""`open_store(url)`: the backend for a store URL (kept apart from base.py, which the backends import)."""

from __future__ import annotations

from urllib.parse import unquote

from components.kvstore.base import KVStore, parse_query


def open_store(url: str | None = None) -> KVStore:
    """`local:///dir` or a plain path -> LocalStore; `mooncake://HOST:PORT?...` -> MooncakeStore."""
    path = local_path(url)
    if path is None:
        from components.kvstore.mooncake import MooncakeStore  # lazy: needs the mooncake wheel

        return MooncakeStore.from_url(url)
    from components.kvstore.local import LocalStore

    return LocalStore(path)


def local_path(url: str | None) -> str | None:
    """The directory of an embedded (local) store URL, None for a mooncake:// URL; ValueError for
    anything else. Opens nothing (the preflight checks a URL with it before any import of the engine)."""
    if not url:
        raise ValueError("store url is empty (use local:///path or mooncake://host:port?metadata=...)")
    if url.startswith("mooncake://"):
        return None
    if url.startswith("local://"):
        u, q = parse_query(url)
        if q:
            raise ValueError(f"store url {url!r}: local:// takes no parameters, got {sorted(q)}")
        return unquote(u.netloc + u.path)
    if "://" in url:
        raise ValueError(f"store url {url!r}: unknown scheme (use local:// or mooncake://)")
    return url
