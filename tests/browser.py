"""Open an HTML file in headless Debian Chromium as a user would, and report what happened: the DOM after its
scripts ran, the errors it raised, every request it made (through a recording proxy, and the page's own
resource timing), and a screenshot's pixels."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import tempfile
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
    "--enable-logging=stderr",
    "--v=0",
]
# Installed first in <head>: a Content-Security-Policy that lets the page fetch nothing (each attempt is a
# reported violation), and a script that collects errors and, after load, writes them, the blocked fetches, the
# resources the page loaded and the plots it drew into a <pre id="tl-probe"> that --dump-dom shows.
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


BROWSER_HOSTS = (
    "update.googleapis.com",
    "accounts.google.com",
    "clients2.google.com",
    "optimizationguide-pa",
)


class _Recorder(BaseHTTPRequestHandler):
    seen: list[str]

    def _refuse(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(403)
        self.end_headers()

    do_GET = do_POST = do_CONNECT = do_HEAD = do_PUT = do_OPTIONS = _refuse

    def log_message(self, *args) -> None:
        pass


def open_page(html_path: Path, *, width: int = 1000, height: int = 1400, budget_ms: int = 20000) -> dict:
    """Load ``html_path`` (with :data:`PROBE` put first in its <head>) in Chromium. Returns ``{"probe": ...,
    "dom": str, "requests": [...], "console": [lines], "png": bytes}``."""
    work = Path(tempfile.mkdtemp(prefix="tl-browser-"))
    try:
        page = work / "page.html"
        text = html_path.read_text(encoding="utf-8")
        page.write_text(text.replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
        _Recorder.seen = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        proxy = [f"--proxy-server=http://127.0.0.1:{server.server_port}", "--proxy-bypass-list=<-loopback>"]
        try:
            cmd = ["chromium", *FLAGS, *proxy, f"--user-data-dir={work / 'profile'}"]
            cmd += [f"--virtual-time-budget={budget_ms}", f"--window-size={width},{height}"]
            cmd += [f"--screenshot={work / 'shot.png'}", "--dump-dom", page.as_uri()]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        finally:
            server.shutdown()
        dom = run.stdout
        start = dom.index('<pre id="tl-probe">') + len('<pre id="tl-probe">')
        import html as _html

        probe = json.loads(_html.unescape(dom[start : dom.index("</pre>", start)]))
        console = [ln for ln in run.stderr.splitlines() if ":CONSOLE" in ln]
        return {
            "probe": probe,
            "dom": dom,
            # Chromium's own background calls (updates, sign-in, time) are not the page's.
            "requests": [r for r in _Recorder.seen if not any(h in r for h in BROWSER_HOSTS)],
            "console": console,
            "png": (work / "shot.png").read_bytes(),
        }
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
