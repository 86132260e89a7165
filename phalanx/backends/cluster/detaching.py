"""The controller's side of detached groups on agents, before a group exists: asking an
agent what detached groups it keeps (``px.attach`` reads the group's description there
first, ``px.attached`` lists them).

Each question goes over a connection of its own, authenticated as every controller's is
(the backend's token and TLS), and ends with it: the agent serves it as a session that
starts no rank, and forgets it once the answer went.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.link import REQUEST_TIMEOUT, AgentLink, AgentNode, parse_host
from phalanx.errors import AuthenticationError, PhalanxError, VersionMismatch
from phalanx.wire import framing

if TYPE_CHECKING:
    from phalanx.backends.cluster.backend import ClusterBackend


def ask(backend: ClusterBackend, host: str, kind: int, *fields: Any) -> Any:
    """The answer of the agent at ``host`` to one request (PhalanxError if it fails)."""
    name, port = parse_host(host)
    joined = backend.dialer.connect(name, port, config.CONNECT_TIMEOUT)
    writer = framing.BacklogWriter("phalanx-detached-question")
    link = AgentLink(joined, writer, backend.max_frame)
    try:
        node = link.nodes[0] = AgentNode(link, 0, name, port, joined.welcome)
        return node.request(kind, *fields, timeout=REQUEST_TIMEOUT)
    finally:
        link.close()
        writer.stop()


def describe(backend: ClusterBackend, name: str) -> dict[str, Any]:
    """Detached group ``name`` as the first of the backend's agents that keeps it says
    (LookupError naming what each said when none does)."""
    said: list[str] = []
    for host in backend.agent_hosts():
        try:
            found: dict[str, Any] = ask(backend, host, agentwire.DESCRIBE, name)
        except (AuthenticationError, VersionMismatch):
            raise  # this side is wrong, not the agent: say so, not that none keeps it
        except (PhalanxError, OSError) as exc:
            said.append(f"{host}: {exc}")
            continue
        return found
    raise LookupError(f"no agent keeps a detached group named {name!r}: "
                      + "; ".join(said))


def listing(backend: ClusterBackend) -> list[dict[str, Any]]:
    """Every detached group the backend's agents keep, each once (with its hosts and the
    ranks of them all)."""
    groups: dict[str, dict[str, Any]] = {}
    for host in backend.agent_hosts():
        try:
            found = ask(backend, host, agentwire.DESCRIBE, "")
        except (AuthenticationError, VersionMismatch):
            raise
        except (PhalanxError, OSError):
            continue
        for group in found:
            known = groups.setdefault(group["name"], {**group, "hosts": [], "ranks": []})
            known["hosts"].append(host)
            known["ranks"] = sorted([*known["ranks"], *group["ranks"]])
    return sorted(groups.values(), key=lambda g: g["name"])
