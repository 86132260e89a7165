"""A small Chrome DevTools Protocol client: a real headless Chromium for the dashboard's tests.

One :class:`Browser` is one Chromium process with a fresh profile, driven over the websocket
of its single page target::

    browser = Browser.launch(find_chromium())
    browser.navigate("http://127.0.0.1:8265/?token=...")
    browser.wait_for("document.querySelectorAll('tr.rank').length === 4", timeout=10)
    browser.screenshot("page.png")
    browser.close()   # Chromium and every process it started gone, its profile removed

How it starts: Chromium is told ``--remote-debugging-port=0`` (it picks a free port, so
parallel runs never collide) and writes the port it took to ``DevToolsActivePort`` in its
profile; the client waits for that file, asks ``/json/list`` for the page target and opens
that target's websocket.

Nothing here can hang a test: every wait has a deadline (the file, the HTTP request, each
websocket read, each command's answer), and what fails says why, with Chromium's stderr
when Chromium itself is the cause. Commands are answered in order on one socket; events
that arrive meanwhile are kept only for what the tests read (``exceptions``: uncaught
errors of the page's scripts) and otherwise dropped.

Closing ends the whole process tree: Chromium's renderers and zygotes are its children,
and once the browser process is gone they would be reparented away from the test (and
from the suite's check that no test leaves a process behind), so the tree is listed
first, then terminated, then killed after a bounded wait.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import websocket  # the websocket-client package

# How long each step may take. A cold start of Chromium on a loaded machine takes a few
# seconds; nothing here should take longer than these unless something is broken.
START_TIMEOUT = 30.0
COMMAND_TIMEOUT = 20.0
CLOSE_TIMEOUT = 5.0

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # the tests run as root in containers, where the sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--mute-audio",
    "--window-size=1280,900",
]


class BrowserError(RuntimeError):
    """Chromium did not start, died, or refused a command; the message says which."""


class JavaScriptError(BrowserError):
    """An expression evaluated in the page threw."""


def find_chromium() -> str | None:
    """Where Chromium is (Debian's ``/usr/bin/chromium`` or ``chromium`` on PATH), or None."""
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    return shutil.which("chromium")


class Browser:
    """One headless Chromium and a connection to its page. Use :meth:`launch`."""

    def __init__(self, proc: subprocess.Popen, profile: Path, stderr_path: Path,
                 ws: websocket.WebSocket) -> None:
        self._proc = proc
        self._profile = profile
        self._stderr_path = stderr_path
        self._ws = ws
        self._next_id = 0
        self._closed = False
        # Uncaught errors of the page's scripts (Runtime.exceptionThrown), as texts.
        self.exceptions: list[str] = []

    # -- starting --------------------------------------------------------------------------

    @classmethod
    def launch(cls, executable: str, timeout: float = START_TIMEOUT,
               flags: tuple[str, ...] = ()) -> Browser:
        """Start Chromium with a fresh profile and connect to its page; ``flags``: more of
        Chromium's switches (``--host-resolver-rules=MAP name 127.0.0.1``, say)."""
        profile = Path(tempfile.mkdtemp(prefix="phalanx-chromium-"))
        stderr_path = profile.parent / f"{profile.name}.stderr"
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen(
                [executable, *CHROMIUM_FLAGS, *flags, f"--user-data-dir={profile}",
                 "--remote-debugging-port=0", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                # its own process group: a Ctrl-C at the terminal is the test's to handle
                start_new_session=True,
            )
        try:
            port = _wait_for_port(proc, profile, stderr_path, timeout)
            ws = _connect_page(port, timeout)
        except BaseException:
            _end_tree(proc)
            _remove(profile, stderr_path)
            raise
        browser = cls(proc, profile, stderr_path, ws)
        try:
            browser.command("Page.enable")
            browser.command("Runtime.enable")
        except BaseException:
            browser.close()
            raise
        return browser

    # -- what the tests use ----------------------------------------------------------------

    def navigate(self, url: str, timeout: float = COMMAND_TIMEOUT) -> None:
        """Open ``url`` and wait until its document (and its deferred scripts) loaded."""
        answer = self.command("Page.navigate", {"url": url}, timeout=timeout)
        if answer.get("errorText"):
            raise BrowserError(f"could not open {url}: {answer['errorText']}")
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'",
                      timeout=timeout)

    def evaluate(self, expression: str, timeout: float = COMMAND_TIMEOUT) -> Any:
        """The value of a JavaScript expression in the page (promises awaited), as JSON
        gives it (an undefined result is None). Statements go in an arrow function called at
        once, ``(() => { const x = ...; return x; })()``: a top-level ``const`` would stay
        declared for the next evaluation, which then throws."""
        answer = self.command("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True,
            "timeout": int(timeout * 1000),
        }, timeout=timeout + 1.0)
        details = answer.get("exceptionDetails")
        if details:
            thrown = details.get("exception", {}).get("description") or details.get("text")
            raise JavaScriptError(f"{expression!r} threw: {thrown}")
        return answer.get("result", {}).get("value")

    def wait_for(self, predicate: str, timeout: float = 10.0, interval: float = 0.1) -> Any:
        """Poll a JavaScript expression until it is truthy; its value. On timeout an
        AssertionError names the expression and the last value it had."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            try:
                last = self.evaluate(predicate, timeout=max(1.0, deadline - time.monotonic()))
            except JavaScriptError as exc:  # e.g. an element not there yet
                last = exc
            else:
                if last:
                    return last
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"{predicate!r} still not true after {timeout} s (last value: {last!r})")
            time.sleep(interval)

    def screenshot(self, path: str | os.PathLike[str]) -> None:
        """Save the whole page (not only the window) as a PNG."""
        metrics = self.command("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics.get("contentSize") or {}
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": True}
        if size.get("width") and size.get("height"):
            params["clip"] = {"x": 0, "y": 0, "width": size["width"],
                              "height": size["height"], "scale": 1}
        answer = self.command("Page.captureScreenshot", params)
        Path(path).write_bytes(base64.b64decode(answer["data"]))

    # -- the protocol ----------------------------------------------------------------------

    def command(self, method: str, params: dict[str, Any] | None = None,
                timeout: float = COMMAND_TIMEOUT) -> dict[str, Any]:
        """Send one DevTools command and return its result, reading (and mostly dropping)
        the events that come before its answer."""
        if self._closed:
            raise BrowserError(f"{method}: the browser is closed")
        self._next_id += 1
        call_id = self._next_id
        deadline = time.monotonic() + timeout
        try:
            self._ws.settimeout(timeout)
            self._ws.send(json.dumps({"id": call_id, "method": method, "params": params or {}}))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrowserError(f"{method}: no answer from Chromium in {timeout} s")
                self._ws.settimeout(left)
                message = json.loads(self._ws.recv())
                if message.get("id") == call_id:
                    break
                self._event(message)
        except (websocket.WebSocketException, OSError) as exc:
            raise BrowserError(f"{method}: the connection to Chromium broke ({exc!r})"
                               f"{self._exit_note()}") from exc
        if "error" in message:
            raise BrowserError(f"{method} failed: {message['error'].get('message')}")
        return message.get("result", {})

    def _event(self, message: dict[str, Any]) -> None:
        if message.get("method") == "Runtime.exceptionThrown":
            details = message.get("params", {}).get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.exceptions.append(str(text))

    def _exit_note(self) -> str:
        if self._proc.poll() is None:
            return ""
        return (f"; Chromium exited with status {self._proc.returncode}, its stderr:\n"
                f"{_tail(self._stderr_path)}")

    # -- stopping --------------------------------------------------------------------------

    def close(self) -> None:
        """End Chromium and every process it started; remove its profile. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(websocket.WebSocketException, OSError):
            self._ws.close(timeout=1)
        _end_tree(self._proc)
        _remove(self._profile, self._stderr_path)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _wait_for_port(proc: subprocess.Popen, profile: Path, stderr_path: Path,
                   timeout: float) -> int:
    """The DevTools port Chromium took, once it wrote it to its profile."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            # The file is written whole, but may be read half-written: two lines, the port
            # and the browser's websocket path; a port of 0 is not one yet.
            port = int(port_file.read_text().splitlines()[0])
            if port > 0:
                return port
        if proc.poll() is not None:
            raise BrowserError(f"Chromium exited with status {proc.returncode} before it "
                               f"opened its DevTools port; its stderr:\n{_tail(stderr_path)}")
        if time.monotonic() >= deadline:
            raise BrowserError(f"Chromium wrote no {port_file} in {timeout} s; its stderr:\n"
                               f"{_tail(stderr_path)}")
        time.sleep(0.05)


def _connect_page(port: int, timeout: float) -> websocket.WebSocket:
    """A websocket to the page target (the about:blank tab Chromium opened)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as reply:
            targets = json.load(reply)
        pages = [t for t in targets if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
        if pages:
            break
        if time.monotonic() >= deadline:
            raise BrowserError(f"Chromium on port {port} has no page target: {targets!r}")
        time.sleep(0.05)
    # No Origin header: Chromium refuses websockets from origins it was not told to allow.
    return websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=timeout,
                                       suppress_origin=True)


def _end_tree(proc: subprocess.Popen) -> None:
    """Terminate Chromium and its descendants, kill what is left after CLOSE_TIMEOUT, and
    reap the browser process itself."""
    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    # Its process group too (it leads one, start_new_session): that also reaches a child
    # forked after the tree was listed. The group exists while the leader is unreaped.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    for member in tree:
        with contextlib.suppress(psutil.Error):
            member.terminate()
    alive = _wait_gone(proc, tree, CLOSE_TIMEOUT)
    if alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for member in alive:
            with contextlib.suppress(psutil.Error):
                member.kill()
        _wait_gone(proc, alive, CLOSE_TIMEOUT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=CLOSE_TIMEOUT)


def _wait_gone(proc: subprocess.Popen, members: list[psutil.Process],
               timeout: float) -> list[psutil.Process]:
    """Wait until every one of ``members`` exited (a zombie counts: its parent reaps it);
    those still alive after ``timeout``. Polls every 20 ms: Chromium's processes exit
    within ~60 ms of SIGTERM, and psutil.wait_procs' growing intervals took ~1 s to see it."""
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()  # reaps the browser process once it exits
        alive = [m for m in members if _running(m)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _running(member: psutil.Process) -> bool:
    try:
        return member.is_running() and member.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _remove(profile: Path, stderr_path: Path) -> None:
    shutil.rmtree(profile, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        stderr_path.unlink()


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<unreadable: {exc}>"
    return text[-limit:] if text.strip() else "<empty>"
