"""What runs inside a rank: the worker runtime and what it needs there.

:mod:`.runtime` (``python -m phalanx.rank.runtime``: the loop that builds the user's object
and runs its calls), :mod:`.bootstrap` (a framework's set-up before user code is imported),
:mod:`.shared` (reading put objects from the node's shared memory), :mod:`.faults`
(injected failures), :mod:`.debugger` (``px.breakpoint()``), :mod:`.tracing` (when it ran
the calls a trace asked about), :mod:`.stacks` (its threads' stacks, on the node side's
request).

May import: :mod:`phalanx.wire`, :mod:`phalanx.world` and the top-level modules. Never the
controller, the launcher, a backend or the node side: a rank starts with as little as it can.
"""
