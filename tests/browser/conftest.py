"""The browser the dashboard's page tests drive: a real headless Chromium (tests/browser/cdp.py).

The tests skip, saying why, when Chromium is not installed (``scripts/setup-browser``
installs it) or the websocket-client package is missing (the ``test`` extra has it).
"""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "chromium_flags(*switches): start this test's "
                            "Chromium with these switches too")


@pytest.fixture
def browser(request):
    """A fresh Chromium for one test, closed however the test went: its whole process tree
    ends before the suite's check that no test leaves a process behind (started per test,
    ~0.4 s, so that check holds test by test without exempting it). A test marked
    ``@pytest.mark.chromium_flags("--switch", ...)`` has Chromium started with those too."""
    marker = request.node.get_closest_marker("chromium_flags")
    flags = tuple(marker.args) if marker else ()
    pytest.importorskip("websocket", reason="the browser tests need websocket-client "
                        "(pip install 'phalanx[test]')")
    from tests.browser import cdp

    executable = cdp.find_chromium()
    if executable is None:
        pytest.skip("Chromium is not installed (no /usr/bin/chromium, no chromium on PATH): "
                    "scripts/setup-browser installs it")
    browser = cdp.Browser.launch(executable, flags=flags)
    try:
        yield browser
    finally:
        browser.close()
