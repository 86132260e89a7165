"""``phalanx run``: a torchrun-like launcher built on :mod:`phalanx.controller`.

:mod:`.run` (one launcher: attempts and restarts), :mod:`.multinode` (``--nnodes N``: one
launcher per node), :mod:`.jobhost` (node 0's host of a multi-node run), :mod:`.roster`
(who forms the run, pure), :mod:`.flags` (torchrun's command line), :mod:`.report` (the
failure report), :mod:`.elastic` (torchrun's variables for the ranks).

May import: the controller and every layer below; never the CLI.
"""
