"""The ``phalanx`` command line: thin front ends over the launcher, the agent and the debugger.

:mod:`.main` parses the command line and maps :class:`phalanx.PhalanxError` to exit codes;
:mod:`.debug` is ``phalanx debug``, the client of a rank's ``px.breakpoint()``.
Nothing imports this package but ``python -m phalanx`` and the ``phalanx`` script.
"""
