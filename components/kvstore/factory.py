"""`open_store(url)`: the backend for a store URL (kept apart from base.py, which the backends import)."""

from __future__ import annotations

from urllib.parse import unquote

from components.kvstore.base import KVStore, parse_query


def open_store(url: str | None = None) -> KVStore:
    """`local:///dir[?ttl=24h&min_free=4G]` or a plain path -> LocalStore;
    `mooncake://HOST:PORT?...` -> MooncakeStore."""
    path = local_path(url)
    if path is None:
        from components.kvstore.mooncake import MooncakeStore  # lazy: needs the mooncake wheel

        return MooncakeStore.from_url(url)
    from components.kvstore.local import LocalStore

    ttl = local_ttl(url)
    options = {} if ttl is None else {"ttl_s": ttl}
    return LocalStore(path, min_free_bytes=local_min_free(url), **options)


def local_path(url: str | None) -> str | None:
    """The directory of an embedded (local) store URL, None for a mooncake:// URL; ValueError for
    anything else. Opens nothing (the preflight checks a URL with it before any import of the engine)."""
    if not url:
        raise ValueError("store url is empty (use local:///path or mooncake://host:port?metadata=...)")
    if url.startswith("mooncake://"):
        return None
    if url.startswith("local://"):
        u, q = parse_query(url)
        if set(q) - {"ttl", "min_free"}:
            raise ValueError(f"store url {url!r}: local:// takes only ttl and min_free (e.g. ?ttl=12h&min_free=20G), "
                             f"got {sorted(q)}")
        local_ttl(url)  # a bad duration or size is caught here too
        local_min_free(url)
        return unquote(u.netloc + u.path)
    if "://" in url:
        raise ValueError(f"store url {url!r}: unknown scheme (use local:// or mooncake://)")
    return url


def local_ttl(url: str) -> float | None:
    """The `?ttl=` of a local:// URL in seconds, None when not given."""
    if not url.startswith("local://"):
        return None
    _, q = parse_query(url)
    if "ttl" not in q:
        return None
    from components.kvstore.base import parse_duration

    return parse_duration(q["ttl"], "local store ttl")


def local_min_free(url: str | None) -> int | None:
    """The `?min_free=` of a local:// URL in bytes (free disk a put must leave), None when not given."""
    if not url or not url.startswith("local://"):
        return None
    _, q = parse_query(url)
    if "min_free" not in q:
        return None
    from components.kvstore.base import parse_size

    return parse_size(q["min_free"], "local store min_free")
