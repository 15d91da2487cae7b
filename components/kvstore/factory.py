"""`open_store(url)`: the backend for a store URL (kept apart from base.py, which the backends import)."""

from __future__ import annotations

from urllib.parse import unquote

from components.kvstore.base import KVStore, parse_query


def open_store(url: str | None = None) -> KVStore:
    """`local:///dir[?ttl=24h&min_free=4G]` or a plain path -> LocalStore;
    `mooncake://HOST:PORT?...` -> MooncakeStore; `memory://NAME` -> this process's MemoryStore."""
    if url and url.startswith("memory://"):
        from components.kvstore.memory import open_memory_store

        return open_memory_store(url)
    path = local_path(url)
    if path is None:
        from components.kvstore.mooncake import MooncakeStore  # lazy: needs the mooncake wheel

        return MooncakeStore.from_url(url)
    from components.kvstore.local import LocalStore

    return LocalStore(path, **local_options(url))


def local_path(url: str | None) -> str | None:
    """The directory of an embedded (local) store URL, None for a mooncake:// or memory:// URL; ValueError for
    anything else. Opens nothing (the preflight checks a URL with it before any import of the engine)."""
    if not url:
        raise ValueError("store url is empty (use local:///path or mooncake://host:port?metadata=...)")
    if url.startswith("mooncake://") or url.startswith("memory://"):
        return None
    if url.startswith("local://"):
        u, q = parse_query(url)
        if set(q) - {"ttl", "min_free"}:
            raise ValueError(f"store url {url!r}: local:// takes only ttl and min_free (e.g. ?ttl=12h&min_free=20G), "
                             f"got {sorted(q)}")
        local_options(url)  # a bad duration or size is caught here too
        return unquote(u.netloc + u.path)
    if "://" in url:
        raise ValueError(f"store url {url!r}: unknown scheme (use local://, mooncake:// or memory://)")
    return url


def local_options(url: str | None) -> dict[str, float | int]:
    """The LocalStore options a local:// URL sets (`?ttl=12h`, `?min_free=20G`), parsed; ValueError
    for a bad value."""
    from components.kvstore.base import parse_duration, parse_size

    if not url or not url.startswith("local://"):
        return {}
    _, q = parse_query(url)
    options: dict[str, float | int] = {}
    if "ttl" in q:
        options["ttl_s"] = parse_duration(q["ttl"], "local store ttl")
    if "min_free" in q:
        options["min_free_bytes"] = parse_size(q["min_free"], "local store min_free")
    return options
