"""Ranks' output on its way to the user: rank-prefixed logs, collapsing, the console.

:mod:`.logs` (streams of lines from every rank), :mod:`.collapse` (identical lines from
many ranks as one, pure), :mod:`.console` (the one place phalanx writes to the terminal),
:mod:`.timeline` (a trace's calls as a Chrome trace, pure), :mod:`.prometheus` (metrics as
Prometheus' text, pure), :mod:`.ownfiles` (files in directories others may reach, checked:
log files, and for the cluster backend its code store and Slurm state).

May import: :mod:`phalanx.wire` (the streams it reads), :mod:`phalanx.world` and the
top-level modules.
"""
