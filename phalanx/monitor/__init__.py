"""The dashboard: a live page of this controller's groups and pools, and their metrics.

:mod:`.server` (``px.dashboard()``: the HTTP server, its token, its routes), :mod:`.state`
(what the page shows, read from the groups and pools when asked), :mod:`.metrics` (the
counts of every group's calls, and their Prometheus text); ``static/`` holds the page
itself (HTML, JavaScript, CSS: no asset from the network).

May import: :mod:`phalanx.controller` (the groups and pools it shows), and the layers
below it.
"""
