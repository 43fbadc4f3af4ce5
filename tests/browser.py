"""Headless Chromium for tests of HTML pages, over the DevTools protocol on a pipe (no network,
no sockets, no driver): load a page and collect its errors (:func:`load_in_chromium`), measure its
layout at a screen width (:func:`measure_layout`: horizontal overflow, content hidden in a scrolling
box, text that overlaps other text or an image) and take a full-page screenshot (:func:`screenshot`).

Tests that use it skip when Chromium is absent; ``make setup`` installs it (Debian: ``apt-get install
-y chromium``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class DevTools:
    """Chromium's DevTools protocol over ``--remote-debugging-pipe`` (fds 3 and 4; no sockets)."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_browser, self._write = os.pipe()
        self._read, from_browser = os.pipe()

        def wire_pipes() -> None:
            # dup first: os.pipe() fds are close-on-exec, and dup2 onto the same number keeps it.
            reader, writer = os.dup(to_browser), os.dup(from_browser)
            os.dup2(reader, 3)
            os.dup2(writer, 4)

        self.process = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            preexec_fn=wire_pipes,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._read], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive(30.0)
            if reply is None:
                raise RuntimeError(f"chromium did not answer {method}")
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            event = self._receive(max(0.0, deadline - time.monotonic()))
            if event is not None:
                self.events.append(event)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):  # it may already be gone
            self.call("Browser.close")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self._write)
        os.close(self._read)


class Page:
    """A page loaded in a tab: :meth:`evaluate` JavaScript, :meth:`call` any DevTools method, and
    the protocol ``events`` received so far."""

    def __init__(self, browser: DevTools, session: str) -> None:
        self.browser = browser
        self._session = session

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.browser.events

    def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return self.browser.call(method, params, self._session)

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` (a promise is awaited)."""
        reply = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression[:60]}…: {reply['exceptionDetails']}")
        return reply["result"].get("value")


@contextlib.contextmanager
def opened(
    page: Path,
    profile: Path,
    width: int = 1400,
    height: int = 1000,
    domains: tuple[str, ...] = (),
) -> Iterator[Page]:
    """``page`` loaded (its load event fired) in a ``width`` × ``height`` viewport, with the
    DevTools ``domains`` enabled besides ``Page`` (their events collected); the browser is closed
    afterwards."""
    assert CHROMIUM is not None
    browser = DevTools(CHROMIUM, profile)
    try:
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        tab = Page(browser, session)
        for domain in ("Page", *domains):
            tab.call(f"{domain}.enable", {})
        tab.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        tab.call("Page.navigate", {"url": page.resolve().as_uri()})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            e.get("method") == "Page.loadEventFired" for e in browser.events
        ):
            browser.drain(0.5)
        yield tab
    finally:
        browser.close()


def load_in_chromium(page: Path, profile: Path) -> dict[str, Any]:
    """Open ``page`` headless and report console errors, failed requests and image states."""
    with opened(page, profile, domains=("Runtime", "Log", "Network")) as tab:
        tab.browser.drain(1.0)  # late console messages and image decoding
        images = tab.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
        events = tab.events
    return {
        "loaded": any(e.get("method") == "Page.loadEventFired" for e in events),
        "errors": [
            e["params"]
            for e in events
            if e.get("method") == "Runtime.exceptionThrown"
            or (
                e.get("method") == "Runtime.consoleAPICalled"
                and e["params"]["type"] in ("error", "assert")
            )
            or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
        ],
        "failed": [e["params"] for e in events if e.get("method") == "Network.loadingFailed"],
        "urls": [
            e["params"]["request"]["url"]
            for e in events
            if e.get("method") == "Network.requestWillBeSent"
        ],
        "images": images,
    }


# What a reader would see go wrong at this width, measured on the rendered page: the page wider
# than the screen, a box whose content is cut off or behind a scroll bar (a hidden table column),
# and text drawn over other text or over an image (each text node's line boxes, by Range rects).
_LAYOUT = r"""
(async () => {
  if (document.fonts) await document.fonts.ready;
  await Promise.all(Array.from(document.images).map(
    i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  const de = document.documentElement;
  // Content of a closed <details> keeps its boxes but is not drawn: checkVisibility knows.
  const visible = el => el.checkVisibility({contentVisibilityAuto: true, opacityProperty: true,
                                            visibilityProperty: true}) &&
    !el.closest('details:not([open]) > :not(summary)') && el.getClientRects().length > 0;
  const describe = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
    (el.className && typeof el.className === 'string' ? '.' + el.className.split(' ')[0] : '') +
    ' "' + (el.textContent || '').trim().slice(0, 40) + '"';
  const clipped = [];
  for (const el of document.body.querySelectorAll('*')) {
    if (!visible(el)) continue;
    const s = getComputedStyle(el);
    const boxes = ['auto', 'scroll', 'hidden', 'clip'];
    if ((boxes.includes(s.overflowX) && el.scrollWidth > el.clientWidth + 1) ||
        (boxes.includes(s.overflowY) && el.scrollHeight > el.clientHeight + 1))
      clipped.push(describe(el));
  }
  const boxes = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (!node.textContent.trim() || !visible(node.parentElement)) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    for (const r of range.getClientRects())
      if (r.width > 0.5 && r.height > 0.5) boxes.push({r, what: describe(node.parentElement)});
  }
  for (const img of document.images)
    if (visible(img)) boxes.push({r: img.getBoundingClientRect(), what: describe(img), image: true});
  boxes.sort((a, b) => a.r.top - b.r.top);
  const overlaps = [];
  for (let i = 0; i < boxes.length; i++) {
    const a = boxes[i].r;
    for (let j = i + 1; j < boxes.length && boxes[j].r.top < a.bottom - 1; j++) {
      if (boxes[i].image && boxes[j].image) continue;
      const b = boxes[j].r;
      const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
      const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
      if (w > 1 && h > 1) overlaps.push([boxes[i].what, boxes[j].what]);
    }
  }
  const wide = Array.from(document.body.querySelectorAll('*'))
    .filter(el => visible(el) && el.getBoundingClientRect().right > de.clientWidth + 1)
    .map(describe);
  return {scrollWidth: de.scrollWidth, clientWidth: de.clientWidth, height: de.scrollHeight,
          wide: wide.slice(0, 20), clipped: clipped.slice(0, 20), overlaps: overlaps.slice(0, 20),
          images: Array.from(document.images).map(i => [i.complete, i.naturalWidth]),
          details: document.querySelectorAll('details').length};
})()
"""

_OPEN_DETAILS = "document.querySelectorAll('details').forEach(d => { d.open = true; }); true"


def measure_layout(page: Path, profile: Path, width: int = 1400) -> dict[str, Any]:
    """The page's layout at ``width`` px, as first shown (``closed``) and with every ``<details>``
    opened (``opened``): ``scrollWidth``, ``clientWidth``, ``height``, and lists of ``wide``
    elements (past the right edge), ``clipped`` boxes (content cut off or scrolled) and
    ``overlaps`` (pairs of text, or text and image, drawn over each other)."""
    with opened(page, profile, width) as tab:
        closed = tab.evaluate(_LAYOUT)
        tab.evaluate(_OPEN_DETAILS)
        return {"closed": closed, "opened": tab.evaluate(_LAYOUT)}


def screenshot(
    page: Path, png: Path, profile: Path, width: int = 1400, open_details: bool = False
) -> Path:
    """A PNG of the whole page at ``width`` px (every ``<details>`` opened on request)."""
    with opened(page, profile, width) as tab:
        if open_details:
            tab.evaluate(_OPEN_DETAILS)
        height = int(tab.evaluate(_LAYOUT)["height"])  # after fonts and images are in
        shot = tab.call(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
            },
        )
    png.write_bytes(base64.b64decode(shot["data"]))
    return png
