"""Readiness checks the manifests run as exec probes (standard library only).

``python -m pipeline.probes segment-registered``: a Mooncake segment holder is ready when the
master lists a segment for this pod's address, i.e. its memory can take payloads, not merely
when its process listens. Reads ``POD_IP`` and ``MC_MASTER_ADDR`` (HOST:PORT of the master's RPC)
from the environment (exec probes get no ``$(VAR)`` expansion); the master's admin API is
``http://MASTER_HOST:9003`` unless ``MC_MASTER_ADMIN`` says otherwise.
"""

from __future__ import annotations

import os
import sys
import urllib.request


def registered_segments(admin_url: str, timeout: float = 2.0) -> list[str]:
    """Segment names (``host:port``) the master knows, from its admin API."""
    with urllib.request.urlopen(f"{admin_url.rstrip('/')}/get_all_segments", timeout=timeout) as r:
        return [line.strip() for line in r.read().decode().splitlines() if line.strip()]


def segment_registered(admin_url: str, host: str, timeout: float = 2.0) -> tuple[bool, str]:
    """(ready, why) for a holder reachable at ``host``."""
    try:
        segments = registered_segments(admin_url, timeout)
    except OSError as e:
        return False, f"master admin API {admin_url} unreachable: {e}"
    if any(s.rpartition(":")[0] == host for s in segments):
        return True, f"segment of {host} registered"
    return False, f"no segment of {host} among {len(segments)} registered at {admin_url}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["segment-registered"]:
        print("usage: python -m pipeline.probes segment-registered", file=sys.stderr)
        return 2
    host = os.environ.get("POD_IP", "")
    master = os.environ.get("MC_MASTER_ADDR", "")
    if not host or not master:
        print("error: POD_IP and MC_MASTER_ADDR must be set", file=sys.stderr)
        return 2
    admin = os.environ.get("MC_MASTER_ADMIN") or f"http://{master.rpartition(':')[0]}:9003"
    ok, why = segment_registered(admin, host)
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
