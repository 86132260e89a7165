"""What every rank of ``phalanx run`` runs: the user's program, as ``__main__``.

:class:`ScriptRunner` is the worker object the launcher's group is made of. It travels to
each rank by reference, so this module is what a rank imports of the launcher: the
standard library and :mod:`.report`'s status arithmetic (whose errors module the rank has
already imported), nothing of the controller's side.

A script runs with ``sys.argv`` and ``sys.path`` as ``python script.py`` sets them; a
module as ``python -m`` does; ``--no-python`` runs a command as the rank's child.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence

from phalanx.launcher.report import signal_status

logger = logging.getLogger(__name__)


class ScriptRunner:
    """The worker object of ``phalanx run``: runs the user's program as ``__main__``."""

    def __init__(self, target: str, args: Sequence[str], is_module: bool,
                 no_python: bool = False, path: str | None = None) -> None:
        self.target = target
        self.args = list(args)
        self.is_module = is_module
        self.no_python = no_python
        # the script's absolute path as the launcher found it: a rank on another node (Ray)
        # does not start in the launcher's directory
        self.path = path

    def run(self) -> int:
        """Run the program; its exit status (``sys.exit(n)`` gives ``n``; an exception
        propagates to the controller with its traceback)."""
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:  # torch's @record writes there, and makes no directories
            os.makedirs(os.path.dirname(error_file), mode=0o700, exist_ok=True)  # private
        if self.no_python:
            return self._run_command()
        import runpy

        from phalanx.rank.runtime import exit_code_of  # the rank's own process: already imported

        if self.is_module:
            sys.argv = [self.target, *self.args]  # runpy sets argv[0] to the module's file
            sys.path.insert(0, os.getcwd())
        else:
            path = self.path or os.path.abspath(self.target)
            sys.argv = [self.target, *self.args]
            sys.path.insert(0, os.path.dirname(path))
        try:
            if self.is_module:
                runpy.run_module(self.target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(path, run_name="__main__")
            status = 0
        except SystemExit as exc:
            status = exit_code_of(exc.code)
        _join_program_threads()  # as the interpreter would before exiting
        sys.stdout.flush()
        sys.stderr.flush()
        return status

    def _run_command(self) -> int:
        """``--no-python``: the target is a command (a shell script, a binary) run as this
        rank's child, in its process group, so forwarded signals reach it; its status as
        a shell gives it (128 + N when signal N ended it)."""
        import subprocess

        sys.stdout.flush()
        sys.stderr.flush()
        code = subprocess.run([self.target, *self.args], check=False).returncode
        return signal_status(code)


def _join_program_threads() -> None:
    """Wait for the non-daemon threads the program started (phalanx's own are daemons), as
    the interpreter does at exit: first its thread-exit hooks, which tell idle
    ``concurrent.futures`` pool threads to finish, then a join of what still runs."""
    # The standard library has no public name for these hooks (concurrent.futures
    # registers them with threading._register_atexit); without them an idle pool thread
    # waits for work forever and the join below never returns.
    for hook in list(getattr(threading, "_threading_atexits", ())):
        try:
            hook()
        except Exception:
            logger.exception("a thread-exit hook failed")
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread.is_alive():
            thread.join()


def path_in_tree(target: str, root: str) -> str | None:
    """``target``'s path relative to the directory ``root``; None if it lies outside."""
    inside = os.path.relpath(os.path.abspath(target), os.path.abspath(root))
    return None if inside == os.pardir or inside.startswith(os.pardir + os.sep) else inside
