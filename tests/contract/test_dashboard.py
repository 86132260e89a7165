"""``px.dashboard()`` over plain HTTP, on every backend: the API's token is required, in a
header (401 without it, 403 with a wrong one), and with it the state, the stacks and
``/metrics`` describe the group. (How the page draws them: tests/browser; what strangers
cannot do: tests/security/test_dashboard_trust.py.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest

import phalanx as px
from tests import helpers
from tests.browser.targets import Worker

WORLD = 2


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(Worker, procs_per_node=WORLD, backend=backend,
                                  echo_output=False) as group:
        yield group


@pytest.fixture(scope="module")
def board(group):
    with px.dashboard() as board:
        yield board


def get(board, path: str, method: str = "GET", token: str | None = None,
        **params: str) -> tuple[int, str, str]:
    """``method`` ``path`` of the dashboard (``token`` in its header): its status, its
    Content-Type and its body."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    url = f"http://{board.host}:{board.port}{path}{query}"
    headers = {} if token is None else {"X-Phalanx-Token": token}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers, method=method),
                                    timeout=30) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, refused.headers["Content-Type"], refused.read().decode()


def test_the_url_carries_the_token_and_the_loopback_address(board):
    parts = urllib.parse.urlsplit(board.url)
    assert parts.scheme == "http" and parts.hostname == "127.0.0.1" and parts.port == board.port
    assert parts.path == "/" and parts.query == "" and parts.fragment == f"token={board.token}"


@pytest.mark.parametrize("path", ["/api/state", "/api/stacks", "/metrics"])
def test_without_the_token_401_with_a_wrong_one_403(board, path):
    assert get(board, path)[0] == 401
    assert get(board, path, token="not-" + board.token)[0] == 403


def test_the_page_and_its_assets_are_served_with_the_token(board):
    status, kind, page = get(board, "/", token=board.token)
    assert status == 200 and kind.startswith("text/html")
    assert 'src="static/app.js"' in page and 'href="static/style.css"' in page
    for asset, kind_wanted in [("app.js", "text/javascript"), ("style.css", "text/css")]:
        status, kind, _ = get(board, f"/static/{asset}", token=board.token)
        assert status == 200 and kind.startswith(kind_wanted), (asset, kind)


def test_the_state_lists_the_group_its_ranks_and_its_calls(board, group):
    group.call("step")
    status, kind, body = get(board, "/api/state", token=board.token)
    assert status == 200 and kind.startswith("application/json")
    state = json.loads(body)
    assert isinstance(state["time"], float) and state["version"] == px.__version__
    shown = next(g for g in state["groups"] if g["name"] == group.name)
    assert shown["world_size"] == WORLD and shown["closed"] is False
    assert [(r["rank"], r["state"]) for r in shown["ranks"]] == [(r, "ready")
                                                                 for r in range(WORLD)]
    call = shown["calls"][-1]
    assert call["method"] == "step" and call["ranks"] == list(range(WORLD))
    assert sorted(call["done"]) == [str(r) for r in range(WORLD)] and call["errors"] == {}
    assert call["sent"] <= min(call["done"].values()) <= state["time"]
    assert shown["counts"]["calls"] >= 1


def test_stacks_has_one_per_rank_and_an_unknown_group_is_a_json_404(board, group):
    status, _, body = get(board, "/api/stacks", "POST", group=group.name, token=board.token)
    assert status == 200
    assert sorted(json.loads(body)["stacks"]) == [str(r) for r in range(WORLD)]
    status, kind, body = get(board, "/api/stacks", "POST", group="no-such-group",
                             token=board.token)
    assert status == 404 and kind.startswith("application/json")
    assert "no-such-group" in json.loads(body)["error"]


def test_metrics_count_the_calls(board, group):
    group.call("step")
    status, kind, text = get(board, "/metrics", token=board.token)
    assert status == 200 and kind.startswith("text/plain")
    assert "phalanx_calls_total" in text and group.name in text
