"""Open an HTML file in headless Debian Chromium as a user would, and report what happened: the DOM after its
scripts ran, the errors it raised, every request the page made (the network events of the page's own DevTools
target, and its resource timing), and a screenshot's pixels. The browser's own background traffic (update
checks and the like, which this Chromium sends even with --disable-background-networking) belongs to no page
and is not counted."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
# Installed first in <head>: a Content-Security-Policy that lets the page fetch nothing (each attempt is a
# reported violation), and a script that collects errors and, after load, writes them, the blocked fetches, the
# resources the page loaded and the plots it drew into a <pre id="tl-probe">.
PROBE = """<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'
 'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:; font-src data:; worker-src blob:">
<script>
window.__tlErrors = []; window.__tlBlocked = [];
document.addEventListener("securitypolicyviolation", function (e) { window.__tlBlocked.push(e.blockedURI); });
window.addEventListener("error", function (e) { window.__tlErrors.push("error: " + e.message); });
window.addEventListener("unhandledrejection", function (e) { window.__tlErrors.push("rejection: " + e.reason); });
(function () { var ce = console.error; console.error = function () {
  window.__tlErrors.push("console.error: " + Array.prototype.join.call(arguments, " ")); ce.apply(console, arguments); }; })();
window.addEventListener("load", function () { setTimeout(function () {
  var plots = Array.prototype.map.call(document.querySelectorAll("div.plot"), function (d) {
    return {id: d.id, svgs: d.querySelectorAll("svg.main-svg").length, traces: d.querySelectorAll("g.trace").length}; });
  var pre = document.createElement("pre"); pre.id = "tl-probe";
  pre.textContent = JSON.stringify({errors: window.__tlErrors, plots: plots, blocked: window.__tlBlocked,
    resources: performance.getEntriesByType("resource").map(function (r) { return r.name; })});
  document.body.appendChild(pre); }, 1000); });
</script>"""


class DevTools:
    """Chromium driven over ``--remote-debugging-pipe``: DevTools protocol messages, NUL-terminated JSON,
    written to the browser's fd 3 and read from its fd 4. Only the standard library is needed, and the page's
    own network activity is told from the browser's (update checks, safe browsing, ...) by the target that
    reports it: events arrive tagged with the session of the page they belong to."""

    def __init__(self, args: list[str], *, timeout_s: float):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def _wire() -> None:  # in the child: the pipe ends at the fds Chromium expects (copies first, so
            # that moving one end onto 3 or 4 cannot close the other)
            reads, writes = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(reads, 3)
            os.dup2(writes, 4)

        self.proc = subprocess.Popen(
            ["chromium", *args, "--remote-debugging-pipe"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # pass_fds would close 3 and 4 after _wire set them; every other fd of ours is non-inheritable
            # (PEP 446), so exec closes it anyway
            close_fds=False,
            preexec_fn=_wire,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._deadline = time.monotonic() + timeout_s
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def _read_message(self) -> dict:
        while b"\0" not in self._buffer:
            left = self._deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("chromium did not answer over the DevTools pipe in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe: " + self.stderr_tail())
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, *, session: str | None = None) -> dict:
        """Send one command and return its result; events that arrive meanwhile are kept in ``events``."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, *, session: str) -> dict:
        """The first event ``method`` of ``session``, seen before or after this call."""
        pos = 0
        while True:
            for event in self.events[pos:]:
                if event.get("method") == method and event.get("sessionId") == session:
                    return event
            pos = len(self.events)
            self.events.append(self._read_message())

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return ""
        return (self.proc.stderr.read() or b"").decode(errors="replace")[-2000:]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("Browser.close")
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)
        self.proc.stderr.close()


def page_requests(events: list[dict], session: str, page_url: str) -> list[str]:
    """The URLs the page itself asked for (network requests its target reported), its own document and the
    data:/blob: URLs it decodes in place aside."""
    return [
        url
        for e in events
        if e.get("sessionId") == session and e.get("method") == "Network.requestWillBeSent"
        if (url := e["params"]["request"]["url"]) != page_url and not url.startswith(("data:", "blob:"))
    ]


def open_page(html_path: Path, *, width: int = 1000, height: int = 1400, budget_s: float = 60.0) -> dict:
    """Load ``html_path`` (with :data:`PROBE` put first in its <head>) in Chromium. Returns ``{"probe": ...,
    "dom": str, "requests": [urls the page asked for], "console": [messages], "png": bytes}``."""
    work = Path(tempfile.mkdtemp(prefix="tl-browser-"))
    try:
        page = work / "page.html"
        text = html_path.read_text(encoding="utf-8")
        page.write_text(text.replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")
        # Nothing leaves the machine, whoever asks: every request goes to a proxy that does not exist.
        args = [*FLAGS, "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]
        args += [f"--user-data-dir={work / 'profile'}", f"--window-size={width},{height}", "about:blank"]
        browser = DevTools(args, timeout_s=budget_s + 120)
        try:
            target = next(t for t in browser.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
            session = browser.call(
                "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
            )["sessionId"]
            for domain in ("Network", "Page", "Runtime"):
                browser.call(f"{domain}.enable", session=session)
            browser.call(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                session=session,
            )
            browser.call("Page.navigate", {"url": page.as_uri()}, session=session)
            browser.wait_for("Page.loadEventFired", session=session)
            probe_js = "(document.getElementById('tl-probe') || {}).textContent || ''"
            deadline = time.monotonic() + budget_s
            while not (
                found := browser.call("Runtime.evaluate", {"expression": probe_js}, session=session)[
                    "result"
                ]["value"]
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the probe did not report within {budget_s} s")
                time.sleep(0.2)
            probe = json.loads(found)
            dom = browser.call(
                "Runtime.evaluate", {"expression": "document.documentElement.outerHTML"}, session=session
            )["result"]["value"]
            png = base64.b64decode(
                browser.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
            )
            console = [
                " ".join(str(a.get("value", a.get("description", ""))) for a in e["params"]["args"])
                for e in browser.events
                if e.get("sessionId") == session and e.get("method") == "Runtime.consoleAPICalled"
            ]
            console += [
                "Uncaught " + e["params"]["exceptionDetails"].get("text", "")
                for e in browser.events
                if e.get("sessionId") == session and e.get("method") == "Runtime.exceptionThrown"
            ]
            requests = page_requests(browser.events, session, page.as_uri())
        finally:
            browser.close()
        return {"probe": probe, "dom": dom, "requests": requests, "console": console, "png": png}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def png_pixels(data: bytes) -> np.ndarray:
    """The pixels of an 8-bit RGB or RGBA PNG (what Chromium's screenshots are) as a (height, width, channels)
    uint8 array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, bit_depth, colour, _, _, interlace = header
    assert bit_depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        f, line = raw[y, 0], raw[y, 1:]
        if f == 0:
            row = line.copy()
        elif f == 1:  # Sub: a running sum per channel
            row = (
                (np.cumsum(line.reshape(width, bpp).astype(np.uint32), axis=0) & 255).astype(np.uint8).ravel()
            )
        elif f == 2:  # Up
            row = line + prev
        else:  # Average, Paeth: each byte depends on the one decoded before it
            cur, up = bytearray(line.tobytes()), prev.tobytes()
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    cur[i] = (cur[i] + (a + b) // 2) & 255
                else:
                    c = up[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            row = np.frombuffer(bytes(cur), dtype=np.uint8)
        out[y] = row
        prev = row
    return out.reshape(height, width, bpp)
