"""The dashboard in a real headless Chromium with a stranger about: another web server on
another port of 127.0.0.1 (a plain ``http.server``, as any local user or tool may run),
whose page the same browser opens after the dashboard's.

- the stranger's server never receives the dashboard's token: not in a cookie (a browser
  sends a host's cookies to all its ports), not in any other header, not in a URL;
- its page cannot make the ranks dump their stacks, whatever it tries -- an ``<img>``, a
  ``<script>``, no-cors fetches (GET and POST, credentials included), a form POST, a fetch
  with the token header (a CORS preflight) -- nor read the state;
- a name rebound to 127.0.0.1 (DNS rebinding, done with Chromium's host resolver rules) is
  refused: its page is not served, so nothing there runs as the dashboard's origin;
- and the dashboard's own page still works: it draws the group, and its stacks button
  shows the stacks (the token travels in its header).

Whether the ranks dumped their stacks is read from the dashboard itself: its ``stacks``
method, wrapped to note each call and then do what it did.
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

import pytest

import phalanx as px
from tests import helpers
from tests.browser.targets import Worker
from tests.browser.test_dashboard_page import SHOWS, all_ready, section

WORLD = 2
REBOUND = "rebound.test"  # the attacker's name, resolved to 127.0.0.1 by Chromium's rules
ATTACKS_END = 30.0  # s for the stranger's page to try everything (each try has 10 s)


@pytest.fixture(scope="module")
def group():
    with helpers.long_lived_group(Worker, nodes=1, procs_per_node=WORLD,
                                  echo_output=False) as group:
        yield group


@pytest.fixture
def board(group, monkeypatch):
    """A dashboard whose stack dumps are noted in ``board.dumped`` (the group names)."""
    with px.dashboard() as board:
        board.dumped = []
        dump = board.stacks

        def noted(name: str) -> Any:
            board.dumped.append(name)
            return dump(name)

        monkeypatch.setattr(board, "stacks", noted)
        yield board


ATTACK_PAGE = """<!doctype html>
<html><body><iframe name="sink" id="sink"></iframe><script>
const D = %(dashboard)s, G = %(group)s;
const stacks = `${D}/api/stacks?group=${encodeURIComponent(G)}`;
const within = (promise, ms) =>
  Promise.race([promise, new Promise((r) => setTimeout(() => r("no answer"), ms))]);
const element = (tag, src) => new Promise((r) => {
  const node = document.createElement(tag);
  node.onload = () => r("loaded");
  node.onerror = () => r("error");
  node.src = src;
  document.body.append(node);
});
const tries = {
  img: element("img", stacks),
  script: element("script", stacks),
  getNoCors: fetch(stacks, { mode: "no-cors", credentials: "include" })
    .then((r) => r.type, (e) => `refused: ${e}`),
  postNoCors: fetch(stacks, { method: "POST", mode: "no-cors", credentials: "include" })
    .then((r) => r.type, (e) => `refused: ${e}`),
  postWithTheHeader: fetch(stacks, { method: "POST", credentials: "include",
    headers: { "X-Phalanx-Token": "a guess" } }).then((r) => r.status, (e) => `refused: ${e}`),
  readState: fetch(`${D}/api/state`, { credentials: "include" })
    .then((r) => r.text(), (e) => `refused: ${e}`),
  form: new Promise((r) => {
    const form = document.createElement("form");
    form.method = "POST";
    form.action = stacks;
    form.target = "sink";
    document.getElementById("sink").onload = () => r("submitted");
    document.body.append(form);
    form.submit();
  }),
};
const names = Object.keys(tries);
Promise.all(names.map((n) => within(tries[n], 10000))).then((values) => {
  const results = Object.fromEntries(names.map((n, i) => [n, String(values[i])]));
  return fetch("/report", { method: "POST", body: JSON.stringify({ cookie: document.cookie,
    results }) });
}).then(() => { window.attacksDone = true; }, (e) => { window.attacksDone = `${e}`; });
</script></body></html>
"""


class Stranger:
    """A plain http.server on another port of 127.0.0.1: serves the attack page at ``/``,
    notes every request it receives (method, path, headers) and the page's report."""

    def __init__(self, page: str) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.report: dict[str, Any] | None = None
        stranger = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _note(self) -> bytes:
                stranger.requests.append((self.command, self.path, dict(self.headers)))
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def do_GET(self) -> None:
                self._note()
                body = page.encode() if self.path == "/" else b""
                self.send_response(200 if self.path == "/" else 404)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = self._note()
                if self.path == "/report":
                    stranger.report = json.loads(body)
                self.send_response(204)
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def test_a_page_on_another_port_gets_no_token_and_cannot_dump_the_stacks(browser, board, group):
    # the dashboard's own page first: it works, and its stacks button dumps them (a POST)
    browser.navigate(board.url)
    browser.wait_for(all_ready(group.name, WORLD), SHOWS)
    browser.evaluate(section(group.name, "g.querySelector('button.stacks').click();"))
    browser.wait_for(section(group.name, f"return g.querySelectorAll('pre.stack').length "
                                         f"=== {WORLD};"), SHOWS)
    assert board.dumped == [group.name]
    assert browser.exceptions == []
    board.dumped.clear()

    # then a stranger's page, in the same browser, on another port of the same address
    dashboard = f"http://127.0.0.1:{board.port}"
    stranger = Stranger(ATTACK_PAGE % {"dashboard": json.dumps(dashboard),
                                       "group": json.dumps(group.name)})
    try:
        browser.navigate(stranger.url)
        done = browser.wait_for("window.attacksDone", ATTACKS_END)
        assert done is True, done
    finally:
        stranger.close()
    report = stranger.report
    print(f"\nthe stranger's tries: {json.dumps(report, indent=1)}")
    assert report is not None and board.token not in json.dumps(report)
    assert report["results"]["readState"].startswith("refused"), report["results"]
    assert {"/", "/report"} <= {path for _, path, _ in stranger.requests}  # it did ask
    for method, path, headers in stranger.requests:
        assert board.token not in path, (method, path)
        leaked = {name: value for name, value in headers.items() if board.token in value}
        assert not leaked, f"{method} {path} carried the dashboard's token: {leaked}"
    assert board.dumped == [], f"a page on another port made the ranks dump their stacks " \
                               f"{len(board.dumped)} times"


@pytest.mark.chromium_flags(f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1")
def test_a_name_rebound_to_the_dashboard_is_refused(browser, board, group):
    # even with the token in the URL: the page is not served under another name, so no
    # script runs with the dashboard's origin there
    rebound = board.url.replace("127.0.0.1", REBOUND, 1)
    assert REBOUND in rebound
    browser.navigate(rebound)
    text = browser.wait_for("document.body && document.body.innerText", SHOWS)
    assert "does not answer to the name" in text, text
    assert browser.evaluate("document.querySelector('section.group') === null")
    assert board.dumped == []
