"""The dashboard's page as a person sees it, in a real headless Chromium, against the real
``px.dashboard()`` of a real group: its ranks, the timeline of its calls, its stacks, and a
rank killed while the page is open (seen without a reload).

The page is read through the DOM it draws (``section.group[data-group]``, ``tr.rank[data-
state]``, ``svg.timeline rect[data-call]``, ``pre.stack[data-rank]``: the page's contract
with these tests, see ``phalanx/monitor/static/app.js``), polled until it shows what is
expected: it draws a new state every second by itself.

``PHALANX_SCREENSHOT_DIR=dir``: the page with the killed rank is saved as dir/dashboard.png.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import phalanx as px
from tests import helpers
from tests.browser.targets import Worker

WORLD = 4
SHOWS = 10.0  # s for the page to show a change: it polls every second


@pytest.fixture(scope="module")
def group():
    with helpers.long_lived_group(Worker, nodes=1, procs_per_node=WORLD,
                                  echo_output=False) as group:
        yield group


@pytest.fixture(scope="module")
def board(group):
    with px.dashboard() as board:
        yield board


def section(name: str, body: str) -> str:
    """A JavaScript expression: ``body`` run with ``g`` the section of group ``name`` (it
    may be undefined: the page has not drawn it yet)."""
    return (f"(() => {{ const g = [...document.querySelectorAll('section.group')]"
            f".find(s => s.dataset.group === {json.dumps(name)}); {body} }})()")


def rank_states(name: str) -> str:
    return section(name, "return g ? [...g.querySelectorAll('tr.rank')]"
                         ".map(r => [Number(r.dataset.rank), r.dataset.state]) : null;")


def all_ready(name: str, world: int = WORLD) -> str:
    return section(name, f"const rows = g ? [...g.querySelectorAll('tr.rank')] : []; "
                         f"return rows.length === {world} && "
                         f"rows.every(r => r.dataset.state === 'ready');")


def test_the_page_shows_the_group_and_its_ranks_ready(browser, board, group):
    browser.navigate(board.url)
    browser.wait_for(all_ready(group.name), SHOWS)
    assert browser.evaluate(rank_states(group.name)) == [[r, "ready"] for r in range(WORLD)]
    header = browser.evaluate("document.querySelector('header').textContent")
    assert "phalanx" in header and f"pid {os.getpid()}" in header and px.__version__ in header
    assert browser.evaluate(section(group.name, "return g.querySelector('h2').textContent;")) \
        == group.name
    cells = browser.evaluate(section(group.name, "return [...g.querySelectorAll("
                                     "'tr.rank[data-rank=\"1\"] td')].map(c => c.textContent);"))
    assert cells[0] == "1" and cells[1] == "ready" and cells[-1] == ""  # no exit cause
    assert cells[-2].endswith("s ago"), cells  # last seen
    assert browser.evaluate("document.getElementById('banner').hidden")
    assert browser.exceptions == []


def test_the_timeline_draws_each_call_on_each_rank(browser, board, group):
    browser.navigate(board.url)
    browser.wait_for(all_ready(group.name), SHOWS)
    for _ in range(3):
        group.call("step", 0.05)
    drawn = browser.wait_for(section(group.name, (
        "if (!g) return null; "
        "const rects = [...g.querySelectorAll('svg.timeline rect[data-method=\"step\"]')]; "
        "const finished = rects.filter(r => !r.classList.contains('inflight')); "
        "const calls = new Set(finished.map(r => r.dataset.call)); "
        "return calls.size >= 3 && finished.length >= 12 && "
        "finished.map(r => [r.dataset.rank, r.dataset.call, "
        "r.querySelector('title').textContent]);")), SHOWS)
    assert {int(rank) for rank, _, _ in drawn} == set(range(WORLD))
    for _, call, title in drawn:
        assert f"step() \u00b7 call {call}" in title and "took" in title, title
    lanes, ticks = browser.evaluate(section(group.name, (
        "const texts = (kind) => [...g.querySelectorAll(`svg.timeline text.${kind}`)]"
        ".map(t => t.textContent); return [texts('lane-label'), texts('tick-label')];")))
    assert lanes == [f"rank {r}" for r in range(WORLD)]
    assert ticks == ["-30 s", "-20 s", "-10 s", "now"]
    assert browser.exceptions == []


def test_the_stacks_button_shows_each_ranks_stack(browser, board, group):
    browser.navigate(board.url)
    browser.wait_for(all_ready(group.name), SHOWS)
    browser.evaluate(section(group.name, "g.querySelector('button.stacks').click();"))
    stacks = browser.wait_for(section(group.name, (
        "const pres = [...g.querySelectorAll('pre.stack')]; "
        f"return pres.length === {WORLD} && "
        "Object.fromEntries(pres.map(p => [p.dataset.rank, p.textContent]));")), SHOWS)
    assert sorted(stacks) == [str(r) for r in range(WORLD)]
    for rank, text in stacks.items():
        assert 'File "' in text, f"rank {rank}'s stack: {text!r}"
    assert browser.evaluate(section(group.name, "return g.querySelector('details.stacks-panel')"
                                                ".open;"))
    assert browser.exceptions == []


def test_a_killed_rank_shows_dead_with_its_cause_without_a_reload(browser, board):
    # Its own group: the module's stays whole for the other tests, in any order.
    with px.WorkerGroup(Worker, nodes=1, procs_per_node=WORLD, echo_output=False) as victims:
        browser.navigate(board.url)
        browser.wait_for(all_ready(victims.name), SHOWS)
        browser.evaluate("window.loadedOnce = true")  # gone if the page reloads
        # on the timeline while rank 2 dies (the shutdown ends the ranks still in it)
        victims.call_async("step", 30.0)
        browser.wait_for(section(victims.name, "return g.querySelectorAll("
                                 "'rect.call.inflight').length === 4;"), SHOWS)
        victims.send_signal(signal.SIGKILL, workers=[2])
        cause = browser.wait_for(section(victims.name, (
            "const row = g.querySelector('tr.rank[data-rank=\"2\"]'); "
            "return row.dataset.state === 'dead' && "
            "row.querySelector('td.exit-cause').textContent;")), SHOWS)
        assert "SIGKILL" in cause or "signal 9" in cause, cause
        assert browser.evaluate(rank_states(victims.name)) == \
            [[0, "ready"], [1, "ready"], [2, "dead"], [3, "ready"]]
        # rank 2's part of the running call failed: red, its error in the tooltip
        error = browser.wait_for(section(victims.name, (
            "const rect = g.querySelector('rect.call.error[data-rank=\"2\"]'); "
            "return rect && rect.querySelector('title').textContent;")), SHOWS)
        assert "error: WorkerDied" in error, error
        assert browser.evaluate("window.loadedOnce === true"), "the page was reloaded"
        directory = os.environ.get("PHALANX_SCREENSHOT_DIR")
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            browser.screenshot(Path(directory) / "dashboard.png")
    assert browser.exceptions == []


def test_a_dashboard_gone_shows_disconnected_and_keeps_the_last_state(browser, group):
    with px.dashboard() as gone:
        browser.navigate(gone.url)
        browser.wait_for(all_ready(group.name), SHOWS)
    banner = browser.wait_for("(() => { const b = document.getElementById('banner'); "
                              "return !b.hidden && b.textContent; })()", SHOWS)
    assert banner.startswith("disconnected:"), banner
    assert browser.evaluate(all_ready(group.name)), "the last state seen is no longer shown"
    assert browser.exceptions == []
