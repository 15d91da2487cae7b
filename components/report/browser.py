"""Open an HTML file in headless Chromium over the DevTools protocol: console errors, image load
state and a full-page screenshot. Used by the report tests (and handy to check a report in CI).

Needs the `chromium` binary (Debian package `chromium`) and `websocket-client`.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
]  # fmt: skip

_IMAGES_JS = """JSON.stringify({
  images: Array.from(document.images).map(i => ({
    alt: i.alt, complete: i.complete, naturalWidth: i.naturalWidth, naturalHeight: i.naturalHeight,
    clientWidth: i.clientWidth, clientHeight: i.clientHeight, cssWidth: Number(i.getAttribute('width')) || null,
    minFontPx: Number(i.dataset.minFontPx) || null, src: i.currentSrc.slice(0, 40),
    // how much the pixels are magnified as drawn (object-fit: contain letterboxes inside the box)
    scale: i.naturalWidth ? (getComputedStyle(i).objectFit === 'contain' ? Math.min
      : Math.max)(i.clientWidth / i.naturalWidth, i.clientHeight / i.naturalHeight) : null})),
  external: Array.from(document.querySelectorAll('[src],[href]'))
    .map(e => e.getAttribute('src') || e.getAttribute('href'))
    .filter(u => /^(https?:)?\\/\\//.test(u)),
  title: document.title,
  height: Math.ceil(document.documentElement.scrollHeight),
  scrollWidth: Math.ceil(document.documentElement.scrollWidth),
  viewportWidth: window.innerWidth
})"""


@dataclass
class PageCheck:
    title: str
    images: list[dict[str, Any]]
    external_urls: list[str]
    console_errors: list[str] = field(default_factory=list)
    screenshot: bytes = b""
    height: int = 0
    scroll_width: int = 0  # the page's width; more than viewport_width: it scrolls sideways
    viewport_width: int = 0
    probes: dict[str, Any] = field(default_factory=dict)  # name -> value of each probe expression

    @property
    def scrolls_sideways(self) -> bool:
        return self.scroll_width > self.viewport_width

    def upscaled_images(self, min_side: int = 0) -> list[dict[str, Any]]:
        """Images drawn larger than their pixels whose longer side is at least `min_side` px
        (figures, drawn at 2x their CSS size, are never among them)."""
        return [i for i in self.images if i.get("scale") and i["scale"] > 1.01
                and max(i["naturalWidth"], i["naturalHeight"]) >= min_side]

    @property
    def broken_images(self) -> list[dict[str, Any]]:
        return [i for i in self.images if not i["complete"] or i["naturalWidth"] <= 0]

    def rendered_font_px(self) -> dict[str, float]:
        """alt -> the smallest text of a figure as displayed: its smallest font at its own CSS size
        (`data-min-font-px`) scaled by how wide the page really shows it."""
        return {i["alt"]: i["minFontPx"] * i["clientWidth"] / i["cssWidth"]
                for i in self.images if i.get("minFontPx") and i.get("cssWidth")}


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


class _CDP:
    def __init__(self, ws_url: str, timeout: float) -> None:
        import websocket  # websocket-client

        self.ws = websocket.create_connection(ws_url, timeout=timeout, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        msg_id = self.next_id
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, method: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if any(e.get("method") == method for e in self.events):
            return
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            self.events.append(msg)
            if msg.get("method") == method:
                return
        raise TimeoutError(f"no {method} within {timeout}s")

    def close(self) -> None:
        self.ws.close()


def _console_errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            out.append(f"log: {entry.get('text')} {entry.get('url', '')}".strip())
    return out


def check_page(
    html_path: str | Path, *, width: int = 1360, timeout: float = 60.0, chromium: str | None = None,
    probes: dict[str, str] | None = None,
) -> PageCheck:
    """Load `html_path` in headless Chromium at `width` CSS px; return image states, the page's
    width, console errors, a full-page PNG and the JSON value of each JavaScript `probes`
    expression (evaluated after the images decoded)."""
    binary = chromium or find_chromium()
    if not binary:
        raise FileNotFoundError("chromium not found (apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="ardit-chromium-")
    proc = subprocess.Popen(
        [
            binary,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cdp = None
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as resp:
            targets = json.loads(resp.read())
        page = next(t for t in targets if t.get("type") == "page")
        cdp = _CDP(page["webSocketDebuggerUrl"], timeout)
        for domain in ("Page", "Runtime", "Log"):
            cdp.call(f"{domain}.enable")
        cdp.call("Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1, mobile=False)
        cdp.events.clear()
        cdp.call("Page.navigate", url=Path(html_path).resolve().as_uri())
        cdp.wait_event("Page.loadEventFired", timeout)
        # Let decoding finish, then read the image states.
        cdp.call(
            "Runtime.evaluate",
            expression="Promise.all(Array.from(document.images).map(i => i.decode().catch(() => null)))",
            awaitPromise=True,
        )
        info = json.loads(cdp.call("Runtime.evaluate", expression=_IMAGES_JS, returnByValue=True)["result"]["value"])
        probed = {name: json.loads(cdp.call("Runtime.evaluate", expression=f"JSON.stringify({expr})",
                                            returnByValue=True)["result"].get("value", "null"))
                  for name, expr in (probes or {}).items()}
        height = int(info["height"])
        cdp.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=min(height, 16000),
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        return PageCheck(
            title=info["title"],
            images=info["images"],
            external_urls=info["external"],
            console_errors=_console_errors(cdp.events),
            screenshot=base64.b64decode(shot["data"]),
            height=height,
            scroll_width=int(info["scrollWidth"]),
            viewport_width=int(info["viewportWidth"]),
            probes=probed,
        )
    finally:
        if cdp is not None:
            cdp.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)
