"""The warden's report of its actor's end when the controller is already gone (a real
socket pair whose other end is closed): it ends quietly instead of raising."""

from __future__ import annotations

import os
import socket
import tempfile

from phalanx.node import warden
from phalanx.wire import framing, streams


def test_a_lost_controller_does_not_crash_the_wardens_exit_report():
    ours, theirs = socket.socketpair()
    theirs.close()  # the controller is gone
    writer = framing.BacklogWriter("test")
    conn = framing.Connection(streams.SocketStream(ours), writer, auth=None)
    notes_r, notes_w = os.pipe()
    try:
        with tempfile.TemporaryFile() as stacks:
            keeper = warden.Warden(conn, notes_r, os.dup(stacks.fileno()), os.getpid())
            keeper._report(0, "note")  # EXITED cannot be sent: dropped, not raised
            assert keeper.conn is None
            keeper.stacks.close()
    finally:
        writer.stop()
        ours.close()
        os.close(notes_r)
        os.close(notes_w)
