"""`ardit store up|down|status|keys|clean|gc`: a single-host Mooncake store for development and tests.

`up` starts master + metadata server + segment holder on 127.0.0.1 (detached) and prints the
store URL to pass as `--kv-store`; `down` stops them by the PIDs in the state file.
"""

from __future__ import annotations

import json

import typer

app = typer.Typer(
    help="Mooncake KV store servers (master, metadata, segment holder) on one host.",
    no_args_is_help=True,
)

_STATE = typer.Option(
    None,
    "--state-dir",
    help="where the pid/state file and logs live "
    "(default $ARDIT_STATE_DIR/mooncake or ~/.cache/ardit/mooncake)",
)


@app.command()
def up(
    host: str = typer.Option("127.0.0.1", help="address every server binds to"),
    master_port: int = typer.Option(50051, help="master RPC port"),
    metadata_port: int = typer.Option(8080, help="HTTP metadata server port"),
    admin_port: int = typer.Option(
        9003, help="master admin/metrics HTTP port (key listing, health)"
    ),
    holder_port: int = typer.Option(
        50052, help="segment holder (mooncake_client) service port"
    ),
    segment: str = typer.Option("4GB", help="memory the segment holder contributes"),
    protocol: str = typer.Option("tcp", help="tcp or rdma"),
    device: str = typer.Option(
        "", help="RDMA device names for the holder, e.g. mlx5_0"
    ),
    state_dir: str | None = _STATE,
) -> None:
    """Start the servers in the background and print the store URL."""
    from components.extras import MissingExtra, require_extra
    from components.kvstore import servers

    try:
        require_extra("mooncake", "ardit store up")  # its programs come with the wheel
    except MissingExtra as exc:
        typer.echo(f"ardit store: error: {exc}", err=True)
        raise typer.Exit(2) from None

    try:
        st = servers.up(state_dir, host=host, master_port=master_port, metadata_port=metadata_port,
                        admin_port=admin_port, holder_port=holder_port, segment=segment, protocol=protocol,
                        device=device)
    except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as exc:
        raise _fail(exc) from None
    typer.echo(f"pids {st.pids}, logs in {st.workdir}")
    typer.echo(st.url)


@app.command()
def down(state_dir: str | None = _STATE) -> None:
    """Stop the servers recorded in the state file (SIGTERM, then SIGKILL after 10 s)."""
    from components.kvstore import servers

    stopped = servers.down(state_dir)
    typer.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing running")


@app.command()
def status(state_dir: str | None = _STATE) -> None:
    """Processes, master health, segments; exit code 1 if not all running."""
    from components.kvstore import servers

    st = servers.status(state_dir)
    typer.echo(json.dumps(st, indent=2))
    if not st["running"]:
        raise typer.Exit(1)


def _open(url: str):
    """The store, or one line and exit code 2 for a bad URL / missing extra."""
    from components.run_kv import open_kv_store

    return open_kv_store(url)


def _fail(exc: Exception) -> typer.Exit:
    """One line (a server's log tail stays in its log file) and exit code 1."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    more = " (the server logs are in the state directory)" if len(lines) > 1 else ""
    typer.echo(f"ardit store: error: {lines[0].rstrip(':')}{more}", err=True)
    return typer.Exit(1)


@app.command()
def keys(
    url: str = typer.Argument(..., help="store URL"),
    prefix: str = typer.Option("", help="list keys that start with this (a run id, 'run/0/', any prefix)"),
) -> None:
    """List payload keys in a store, then the orphaned parts (a put that never finished), marked."""
    from components.kvstore.base import StoreError

    with _open(url) as s:
        try:
            found, parts = s.keys(prefix), s.orphaned_parts(prefix)
        except StoreError as exc:
            raise _fail(exc) from None
        for k in found:
            typer.echo(k)
        for k in parts:
            typer.echo(f"{k}\torphaned part (no payload; `ardit store gc` removes it)")


@app.command()
def gc(
    url: str = typer.Argument(..., help="store URL"),
    older_than: str = typer.Option(
        "", help="remove payloads and orphaned parts put longer ago than this (6h, 30m, 90s; default: the "
        "store's TTL: local 24h or ?ttl=, mooncake its pin_ttl)"),
) -> None:
    """Remove orphaned KV (killed runs never resumed): everything older than the TTL. Safe to run
    any time, e.g. from cron; AR and DiT steps also do it when they start. On an output root
    (local:///out), the embedded stores of every run under it (<out>/<run>/_kv)."""
    from components.kvstore.base import StoreError, parse_duration

    with _open(url) as s:
        try:
            age = parse_duration(older_than, "--older-than") if older_than else s.ttl_s
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        if age is None:
            raise typer.BadParameter("this store keeps payloads until deleted (no TTL): give --older-than")
        try:
            typer.echo(f"expired {s.expire(age)} payload(s) older than {age:g} s from {s.url}")
        except (StoreError, ValueError) as exc:
            raise _fail(exc) from None


@app.command()
def clean(
    url: str = typer.Argument(..., help="store URL"),
    run: str = typer.Option("", help="delete every key of this run"),
    older_than: float = typer.Option(
        -1, help="delete payloads put more than this many seconds ago"
    ),
) -> None:
    """Run-level cleanup (--run) and/or orphan expiry (--older-than)."""
    from components.kvstore.base import StoreError

    if not run and older_than < 0:
        raise typer.BadParameter("give --run RUN and/or --older-than SECONDS")
    with _open(url) as s:
        try:
            if run:
                typer.echo(f"deleted {s.delete_prefix(run)} payload(s) of run {run}")
            if older_than >= 0:
                typer.echo(
                    f"expired {s.expire(older_than)} payload(s) older than {older_than:g} s"
                )
        except (StoreError, ValueError) as exc:
            raise _fail(exc) from None


if __name__ == "__main__":  # `python -m components.kvstore.cli gc URL`: the cluster's ardit-kv-gc CronJob
    app()
