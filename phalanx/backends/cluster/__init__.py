"""The cluster backend: ranks on nodes (hosts, Kubernetes pods) served by ``phalanx agent``.

The controller's side: :mod:`.backend` (:class:`ClusterBackend`), :mod:`.link` (a node's
connection to its agent), :mod:`.members` (who the nodes are, over time), :mod:`.dns`
(discovery). Both sides: :mod:`.messages` (the agents' own frames), :mod:`.tree` (agents in
a tree), :mod:`.codesync` (shipping code), :mod:`.token` (the shared token's rules). The
node's side: :mod:`.agent` (the daemon).
:mod:`.k8s` writes the manifests that run agents.

May import: :mod:`phalanx.backends.base`, the node side and the layers below; never another
backend or the controller.
"""
