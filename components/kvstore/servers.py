"""Start / stop a single-host Mooncake store: master, HTTP metadata server, segment holder.

- `mooncake_master` with RPC and admin HTTP on `host` (default 127.0.0.1).
- `mooncake_http_metadata_server --host HOST` (the master's built-in one binds 0.0.0.0).
- `mooncake_client`: a standalone process that holds the store memory (`segment`), so payloads
  outlive the AR process that put them (the steps themselves contribute 0 bytes).

All processes get `MC_TCP_BIND_ADDRESS=HOST`. Mooncake binds the holder's transfer-engine data
and handshake ports to the any-address regardless, so on 127.0.0.1 the holder also runs with a
small LD_PRELOAD shim (native/loopback_bind.c, built with the system C compiler) that turns those
binds into loopback binds; without a compiler `up` says those ports listen on every interface.
`MooncakeServers` is a context manager (tests,
benchmarks); `up()`/`down()` keep a JSON state file (pids, ports, url) so another process can
stop them (the `ardit store` CLI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

from components.kvstore.base import parse_size

DEFAULT_STATE_DIR = (
    Path(os.environ.get("ARDIT_STATE_DIR", Path.home() / ".cache" / "ardit"))
    / "mooncake"
)


def find_binary(name: str) -> str:
    """The mooncake wheel puts its programs next to the venv's python."""
    cand = Path(sys.executable).parent / name
    if cand.exists():
        return str(cand)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(
            f"{name} not found next to {sys.executable} or on PATH: "
            "pip install mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _http_ok(url: str, timeout: float = 1.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:  # the server answered: it is up
        return f"HTTP {e.code}"
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
        )
    except OSError:
        return ""


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@dataclass
class ServerState:
    host: str
    master_port: int
    metadata_port: int
    admin_port: int
    holder_port: int
    segment: int
    protocol: str
    workdir: str
    pids: dict[str, int] = field(default_factory=dict)  # name -> pid
    markers: dict[str, str] = field(
        default_factory=dict
    )  # name -> program name in its cmdline

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    @property
    def url(self) -> str:
        return (
            f"mooncake://{self.host}:{self.master_port}?metadata={self.metadata_url}"
            f"&protocol={self.protocol}&admin={self.admin_url}"
        )


class MooncakeServers:
    """Master + metadata server + segment holder on one host. Ports 0 = pick free ones."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        master_port: int = 0,
        metadata_port: int = 0,
        admin_port: int = 0,
        holder_port: int = 0,
        segment: int | str = "2GB",
        protocol: str = "tcp",
        device: str = "",
        workdir: str | os.PathLike | None = None,
        start_timeout: float = 60.0,
        master_flags: tuple[str, ...] = (),
    ):
        pick = lambda p: p or free_port(host)
        wd = (
            Path(workdir)
            if workdir
            else Path(os.environ.get("TMPDIR", "/tmp"))
            / f"ardit-mooncake-{os.getpid()}-{id(self):x}"
        )
        self.state = ServerState(
            host=host,
            master_port=pick(master_port),
            metadata_port=pick(metadata_port),
            admin_port=pick(admin_port),
            holder_port=pick(holder_port),
            segment=parse_size(segment, "segment"),
            protocol=protocol,
            workdir=str(wd),
        )
        self.device = device
        self.start_timeout = start_timeout
        self.master_flags = master_flags
        self._procs: dict[str, subprocess.Popen] = {}
        self._argv: dict[str, tuple[list[str], str | None]] = {}
        self.loopback_shim: str | None = None  # set by start() when the holder's binds are confined
        self._own_workdir = (
            not workdir
        )  # a temp dir we made: removed (logs included) on stop

    @property
    def url(self) -> str:
        return self.state.url

    def restart(self, name: str) -> None:
        """Kill one server (SIGKILL, as a crash) and start it again with the same command line
        (tests: a master restart loses every key; clients must cope)."""
        proc = self._procs[name]
        proc.kill()
        proc.wait(timeout=30)
        argv, preload = self._argv[name]
        self._spawn(name, argv, preload)
        if name == "master":
            s = self.state
            self._wait("master", lambda: (_http_ok(f"{s.admin_url}/health") or "").find('"ok"') >= 0)

    def _spawn(self, name: str, argv: list[str], preload: str | None = None) -> None:
        self._argv[name] = (argv, preload)
        s = self.state
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=s.host)
        if preload:
            env["LD_PRELOAD"] = " ".join(filter(None, [preload, env.get("LD_PRELOAD")]))
        with open(
            Path(s.workdir) / f"{name}.log", "ab"
        ) as log:  # the child keeps its own copy of the fd
            # own session: Ctrl-C in a terminal does not kill the servers behind `ardit store up`
            p = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=s.workdir,
                start_new_session=True,
            )
        self._procs[name] = p
        s.pids[name] = p.pid
        s.markers[name] = Path(argv[0]).name

    def _wait(self, name: str, ready) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            p = self._procs[name]
            if p.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {p.returncode}:\n{_tail(Path(self.state.workdir) / f'{name}.log')}"
                )
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"{name} not ready in {self.start_timeout:g} s:\n{_tail(Path(self.state.workdir) / f'{name}.log')}"
        )

    def start(self) -> MooncakeServers:
        s = self.state
        Path(s.workdir).mkdir(parents=True, exist_ok=True)
        try:
            self._spawn(
                "master",
                [
                    find_binary("mooncake_master"),
                    f"-rpc_address={s.host}",
                    f"-rpc_port={s.master_port}",
                    f"-metrics_host={s.host}",
                    f"-metrics_port={s.admin_port}",
                    *self.master_flags,
                ],
            )
            self._spawn(
                "metadata",
                [
                    find_binary("mooncake_http_metadata_server"),
                    "--host",
                    s.host,
                    "--port",
                    str(s.metadata_port),
                ],
            )
            self._wait(
                "master",
                lambda: (_http_ok(f"{s.admin_url}/health") or "").find('"ok"') >= 0,
            )
            self._wait(
                "metadata",
                lambda: _http_ok(f"{s.metadata_url}?key=ardit_probe") is not None,
            )
            self.loopback_shim = (loopback_shim(Path(s.workdir)) if s.host in ("127.0.0.1", "localhost")
                                  else None)
            self._spawn(
                "holder",
                [
                    find_binary("mooncake_client"),
                    f"-host={s.host}",
                    f"-port={s.holder_port}",
                    f"-global_segment_size={s.segment}",
                    f"-master_server_address={s.host}:{s.master_port}",
                    f"-metadata_server={s.metadata_url}",
                    f"-protocol={s.protocol}",
                    *([f"-device_names={self.device}"] if self.device else []),
                ],
                preload=self.loopback_shim,
            )
            self._wait(
                "holder",
                lambda: bool(
                    (_http_ok(f"{s.admin_url}/get_all_segments") or "").strip()
                ),
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        stop_pids(self.state, timeout)
        for p in self._procs.values():
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self._own_workdir:
            shutil.rmtree(self.state.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def loopback_shim(workdir: Path) -> str | None:
    """Build native/loopback_bind.c into `workdir` (an LD_PRELOAD library); None without a C
    compiler or when the build fails (the caller then says the ports are not confined)."""
    source = Path(__file__).with_name("native") / "loopback_bind.c"
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc or not source.is_file():
        return None
    out = workdir / "loopback_bind.so"
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(source), "-ldl"],
                          capture_output=True, text=True)
    return str(out) if proc.returncode == 0 else None


def stop_pids(state: ServerState, timeout: float = 10.0) -> list[str]:
    """SIGTERM each recorded server (holder first), SIGKILL after `timeout`. Only PIDs whose
    command line still names the program we started are signalled (PIDs get reused)."""
    stopped = []
    for name in ("holder", "metadata", "master"):
        pid = state.pids.get(name)
        if (
            not pid
            or not _alive(pid)
            or state.markers.get(name, "") not in _cmdline(pid)
        ):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                _reap(pid)
                time.sleep(0.05)
        stopped.append(name)
    return stopped


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: its parent (or init) reaps it


# ---------------------------------------------------------------- detached servers for the CLI


def state_file(state_dir: str | os.PathLike | None = None) -> Path:
    return Path(state_dir or DEFAULT_STATE_DIR) / "servers.json"


def up(state_dir: str | os.PathLike | None = None, **kw: Any) -> ServerState:
    sf = state_file(state_dir)
    if sf.exists():
        old = load_state(state_dir)
        if old and any(_alive(p) for p in old.pids.values()):
            raise RuntimeError(
                f"servers already running (state {sf}); run `down` first"
            )
    sf.parent.mkdir(parents=True, exist_ok=True)
    srv = MooncakeServers(workdir=sf.parent, **kw).start()
    sf.write_text(json.dumps(asdict(srv.state), indent=2))
    if srv.state.host in ("127.0.0.1", "localhost") and not srv.loopback_shim:
        print("note: no C compiler found, so the segment holder's transfer-engine ports listen on every "
              "interface (Mooncake binds them to the any-address); install gcc to confine them to 127.0.0.1",
              file=sys.stderr)
    return srv.state


def load_state(state_dir: str | os.PathLike | None = None) -> ServerState | None:
    sf = state_file(state_dir)
    if not sf.exists():
        return None
    return ServerState(**json.loads(sf.read_text()))


def down(state_dir: str | os.PathLike | None = None) -> list[str]:
    st = load_state(state_dir)
    if st is None:
        return []
    stopped = stop_pids(st)
    state_file(state_dir).unlink(missing_ok=True)
    return stopped


def status(state_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    st = load_state(state_dir)
    if st is None:
        return {"running": False, "detail": f"no state file at {state_file(state_dir)}"}
    procs = {
        n: (_alive(p) and st.markers.get(n, "") in _cmdline(p))
        for n, p in st.pids.items()
    }
    health = _http_ok(f"{st.admin_url}/health")
    segments = (_http_ok(f"{st.admin_url}/get_all_segments") or "").split()
    return {
        "running": all(procs.values()),
        "url": st.url,
        "processes": procs,
        "pids": st.pids,
        "master_health": health,
        "segments": segments,
        "workdir": st.workdir,
    }
