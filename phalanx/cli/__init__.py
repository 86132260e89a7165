"""The ``phalanx`` command line: thin front ends over the launcher, the agent and the debugger.

:mod:`.main` parses the command line and maps :class:`phalanx.PhalanxError` to exit codes.
Nothing imports this package but ``python -m phalanx`` and the ``phalanx`` script.
"""
