"""``phalanx agent``: the daemon on every node of a cluster backend.

:mod:`.daemon` (accepting controllers), :mod:`.ranks` (one controller's ranks on this node),
:mod:`.branch` (this agent's part in a tree), :mod:`.share` (the node's copy of put objects),
:mod:`.http` (``/health`` and ``/metrics``).

The node side: may import :mod:`phalanx.node`, the cluster's shared modules
(:mod:`..messages`, :mod:`..tree`, :mod:`..codesync`, :mod:`..token`) and the layers below;
never the controller's side of the cluster backend (:mod:`..backend`, :mod:`..link`,
:mod:`..members`).
"""
