"""The node side: starting, supervising and stopping ranks on the machine they run on.

:mod:`.spawn` (the one spawner, and the one account of a rank that died),
:mod:`.supervisor` and :mod:`.keeper` (the node supervisor, the ranks' parent and reaper),
:mod:`.proctree` (process trees from ``/proc``), :mod:`.stacks` (a rank's stacks taken from
outside), :mod:`.shm` (the one holder of put objects, in shared-memory blocks),
:mod:`.machine` (what only this machine can tell: free ports, GPUs, installed packages, its
identity).

Used by every backend's node side (the local backend, the cluster agent, the Ray actor).
May import: :mod:`phalanx.wire`, :mod:`phalanx.output`, :mod:`phalanx.world` and the
top-level modules. Never the controller or a backend.
"""
