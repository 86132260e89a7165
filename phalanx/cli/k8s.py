"""``phalanx k8s manifest``: the Kubernetes objects that run the cluster backend's agents,
printed as YAML for ``kubectl apply -f -``.

What the objects are, and why, is :mod:`phalanx.backends.cluster.k8s`'s business (pure:
:func:`~phalanx.backends.cluster.k8s.manifest` checks every option and builds plain data);
this module is the command line around it: the options, the exit status, the warning on
stderr, and the YAML. The YAML is PyYAML's (``safe_dump``: plain data only, keys in the
order the objects give them, block style, sequences indented under their key, no line
folded), with each object's notes (:func:`~phalanx.backends.cluster.k8s.notes`) as ``#``
lines at the top of its document. PyYAML is imported only when a manifest is written:
``phalanx run`` and ``import phalanx`` do not pay for it.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Sequence
from typing import Any

from phalanx.backends.cluster.k8s import (
    DEFAULT_NAMESPACE,
    DEFAULT_PORT,
    DEFAULT_UID,
    GPU_RESOURCE,
    TLS_SUFFIX,
    TOKEN_KEY,
    manifest,
    notes,
)

USAGE_ERROR = 2  # the exit status for a bad command line, as phalanx.cli.main's

MANIFEST_DESCRIPTION = """\
Print the Kubernetes objects that run one phalanx agent per node, as YAML for
kubectl apply -f -, made for a shared cluster: a Secret holding a fresh random token
(unless --token-secret names an existing one), a headless Service NAME giving the pods
stable DNS names, a NetworkPolicy NAME and a StatefulSet NAME of REPLICAS pods (at most
one per node), each running
  phalanx agent --host 0.0.0.0 --port PORT --http-port HTTP_PORT
                --store /var/lib/phalanx/store
                --tls-cert /etc/phalanx-tls/tls.crt --tls-key /etc/phalanx-tls/tls.key
with the token in $PHALANX_TOKEN and GET /health on the http port as its readiness and
liveness probes.

The pods run as a fixed non-root user (--run-as-user, --run-as-group) with no privilege
escalation, no capabilities, the runtime's default seccomp profile, a read-only root
filesystem (emptyDir volumes for the code store, /tmp and $HOME) and no service account
token: the restricted Pod Security Standard.

TLS is on: the agents serve it with the kubernetes.io/tls Secret --tls-secret (default
NAME-tls; its certificate names *.NAME.NAMESPACE.svc.cluster.local), and the controller
needs tls="ca.pem". --insecure leaves it off: frames stay authenticated, but not
encrypted.

The NetworkPolicy admits to the control port only the controller's pods
(--controller-selector, required) and the agents themselves (tree links, copies of kept
results); to the HTTP port only --metrics-selector pods. The kubelet's probes come from
the node, which most network plugins do not subject to NetworkPolicy, so they pass while
strangers cannot reach /health.
"""

MANIFEST_EPILOG = """\
the controller connects to the pods by name:
  px.ClusterBackend(hosts=phalanx.backends.cluster.k8s.hosts(NAME, REPLICAS, NAMESPACE, PORT),
                    token_file=..., tls="ca.pem")
  that is NAME-0.NAME.NAMESPACE.svc.cluster.local:PORT, NAME-1..., with the token from
  kubectl -n NAMESPACE get secret NAME-token -o jsonpath='{.data.token}' | base64 -d
  (in a pod: $PHALANX_TOKEN from that Secret, and the labels --controller-selector names)

exit status:
  0        the manifest was printed
  2        bad command line (nothing is printed)

examples:
  kubectl -n ml create secret tls trainer-tls --cert agents.crt --key agents.key
  phalanx k8s manifest --name trainer --replicas 4 --image registry.example.com/app:1.0 \\
      --namespace ml --controller-selector app=trainer-controller \\
      --cpu 16 --memory 64Gi --gpus 8 | kubectl apply -f -
  phalanx k8s manifest --name trainer --replicas 2 --image app:1.0 --token-secret mine \\
      --controller-selector app=ctl --controller-namespace jobs --tls-secret agents-tls
  phalanx k8s manifest --name trainer --replicas 2 --image app:1.0 --insecure \\
      --no-network-policy                    # a mesh encrypts and polices the traffic
"""

INSECURE_WARNING = """\
phalanx k8s manifest: WARNING: --insecure: the agents will serve plain TCP, without TLS.
  Frames are authenticated but NOT encrypted: anyone who can read the pods' traffic reads
  every call's arguments, results and output. Use it only on a network that is encrypted
  already (a service mesh's mTLS, WireGuard between nodes); otherwise drop --insecure and
  give --tls-secret a kubernetes.io/tls Secret.
"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``k8s manifest`` to the ``phalanx`` parser's subcommands (``commands``, from its
    ``add_subparsers()``); the parsed options carry ``func=main``."""
    command: argparse.ArgumentParser = commands.add_parser(
        "k8s",
        help="Kubernetes manifests that run the cluster backend's agents",
        description="Kubernetes manifests that run the cluster backend's agents.",
    )
    command.set_defaults(func=main)
    actions = command.add_subparsers(dest="k8s_command", metavar="ACTION")
    actions.required = True
    parser = actions.add_parser(
        "manifest",
        help="print a Secret, a headless Service, a NetworkPolicy and a StatefulSet of "
             "agents as YAML",
        description=MANIFEST_DESCRIPTION,
        epilog=MANIFEST_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--name", required=True,
                        help="the StatefulSet's and the Service's name; pods are NAME-0, ...")
    parser.add_argument("--replicas", type=int, required=True, metavar="N",
                        help="agent pods, one per node")
    parser.add_argument("--image", required=True,
                        help="a container image with phalanx (and the job's code) installed")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                        help=f"the namespace of every object (default: {DEFAULT_NAMESPACE})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"the agents' control port (default: {DEFAULT_PORT})")
    parser.add_argument("--http-port", type=int, metavar="PORT",
                        help="the agents' /health and /metrics port (default: --port + 1)")
    parser.add_argument("--token-secret", metavar="SECRET",
                        help=f"use this existing Secret's {TOKEN_KEY!r} key as the token "
                             "instead of printing a new Secret")
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--tls-secret", metavar="SECRET",
                     help="the existing kubernetes.io/tls Secret the agents serve TLS with "
                          f"(its tls.crt and tls.key; default: NAME{TLS_SUFFIX})")
    tls.add_argument("--insecure", action="store_true",
                     help="serve no TLS: frames are authenticated, not encrypted (only where "
                          "the network is encrypted already)")
    parser.add_argument("--controller-selector", metavar="LABELS",
                        help="KEY=VALUE[,KEY=VALUE...]: the labels of the controller's pods, "
                             "the only pods (with the agents) the NetworkPolicy admits to the "
                             "control port; required unless --no-network-policy")
    parser.add_argument("--controller-namespace", metavar="NAMESPACE",
                        help="the controller's pods' namespace (default: --namespace)")
    parser.add_argument("--metrics-selector", metavar="LABELS",
                        help="KEY=VALUE[,...]: pods admitted to the HTTP port, e.g. a "
                             "Prometheus (default: none; the kubelet's probes need no rule)")
    parser.add_argument("--metrics-namespace", metavar="NAMESPACE",
                        help="the --metrics-selector pods' namespace (default: --namespace)")
    parser.add_argument("--no-network-policy", dest="network_policy", action="store_false",
                        help="print no NetworkPolicy (anything that reaches the pods may "
                             "connect; the token still guards the control port)")
    parser.add_argument("--run-as-user", type=int, default=DEFAULT_UID, metavar="UID",
                        help=f"the pods' user, never 0 (default: {DEFAULT_UID})")
    parser.add_argument("--run-as-group", type=int, default=DEFAULT_UID, metavar="GID",
                        help=f"the pods' group and fsGroup, never 0 (default: {DEFAULT_UID})")
    parser.add_argument("--cpu", metavar="QUANTITY",
                        help="CPU request and limit of each pod, e.g. 16 or 500m")
    parser.add_argument("--memory", metavar="QUANTITY",
                        help="memory request and limit of each pod, e.g. 64Gi")
    parser.add_argument("--gpus", type=int, default=0, metavar="G",
                        help=f"{GPU_RESOURCE} limit of each pod (default: none)")
    return command


def main(options: argparse.Namespace) -> int:
    """Run ``phalanx k8s ...``; the exit status."""
    if options.k8s_command != "manifest":  # pragma: no cover - argparse checks
        print(f"phalanx k8s: unknown action {options.k8s_command!r}", file=sys.stderr)
        return USAGE_ERROR
    try:
        objects = manifest(
            options.name, options.replicas, options.image, namespace=options.namespace,
            port=options.port, http_port=options.http_port, token_secret=options.token_secret,
            cpu=options.cpu, memory=options.memory, gpus=options.gpus,
            tls_secret=options.tls_secret, insecure=options.insecure,
            controller_selector=options.controller_selector,
            controller_namespace=options.controller_namespace,
            metrics_selector=options.metrics_selector,
            metrics_namespace=options.metrics_namespace,
            network_policy=options.network_policy, run_as_user=options.run_as_user,
            run_as_group=options.run_as_group)
        text = to_yaml(objects, notes(objects))
    except ValueError as exc:
        print(f"phalanx k8s manifest: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if options.insecure:
        sys.stderr.write(INSECURE_WARNING)
    sys.stdout.write(text)
    return 0


# -- YAML ---------------------------------------------------------------------------------

NO_WRAP = 1 << 30  # PyYAML's line width: no string is folded (each stays greppable)

# Written quoted although PyYAML's YAML 1.1 rules read it as a string: what other readers
# may take for something else. kubectl's reader (go-yaml) takes y and n for booleans and
# parses numbers as Go does (1e3, 0o17, 1_000); YAML 1.2 reads 1e3 and 0o17 as numbers. So
# every string that starts like a number is quoted (500m, 64Gi, 0.0.0.0 too: harmless).
_OTHER_READERS = r"^(?:[yYnN]|[-+]?\.?[0-9].*)$"
_OTHER_READERS_FIRST = list("yYnN-+.0123456789")
_OTHER_READERS_TAG = "tag:phalanx,2025:not-a-plain-string"  # any tag but str's


def to_yaml(objects: Sequence[Any], comments: Sequence[str | None] | None = None) -> str:
    """``objects`` as YAML documents separated by ``---`` lines, written by PyYAML's
    ``safe_dump``: block style, keys in their order, lists indented under their key, other
    characters than ASCII escaped in double-quoted strings.

    Plain data (dicts, lists, str, int, float, bool, None) reads back as written, with
    YAML 1.1 or 1.2 readers, kubectl's included: a string that such a reader could take for
    anything else is quoted. What ``safe_dump`` cannot write (a tuple, an arbitrary object)
    raises TypeError. ``comments``, one for each object (or None), are written as ``#``
    lines at the start of its document (:func:`~phalanx.backends.cluster.k8s.notes`); a
    comment holds printable characters and line breaks only (ValueError otherwise).
    """
    if comments is None:
        comments = [None] * len(objects)
    if len(comments) != len(objects):
        raise ValueError(f"to_yaml needs one comment (or None) for each of the "
                         f"{len(objects)} objects, got {len(comments)}")
    heads = ["".join(_comment(text)) for text in comments]
    import yaml  # type: ignore[import-untyped]  # no stubs: types-PyYAML is not a dependency

    dumper = _dumper()
    documents = []
    for obj in objects:
        try:
            # ASCII only (other characters escaped): with allow_unicode, PyYAML writes a
            # NEL (U+0085) into a quoted string as is, and reads it back as a space
            documents.append(yaml.dump(obj, Dumper=dumper, sort_keys=False,
                                       default_flow_style=False, allow_unicode=False,
                                       width=NO_WRAP))
        except yaml.representer.RepresenterError as exc:
            raise TypeError(f"to_yaml writes plain data only (dicts, lists, str, int, "
                            f"float, bool, None): {exc}") from exc
    return "---\n".join(head + text for head, text in zip(heads, documents, strict=True))


@functools.cache
def _dumper() -> Any:
    """PyYAML's SafeDumper, with lists indented under their key and :data:`_OTHER_READERS`
    quoted; built on first use, so that only writing a manifest imports PyYAML."""
    import yaml

    class Dumper(yaml.SafeDumper):  # type: ignore[misc]  # yaml has no stubs: Any
        def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
            # "ports:\n  - name: ..." (as Kubernetes' docs write it), not "ports:\n- ..."
            super().increase_indent(flow, False)

    Dumper.add_implicit_resolver(_OTHER_READERS_TAG, re.compile(_OTHER_READERS),
                                 _OTHER_READERS_FIRST)
    return Dumper


def _comment(text: str | None) -> list[str]:
    if text is None:
        return []
    if not isinstance(text, str):
        raise TypeError(f"to_yaml writes comments that are strings, got {text!r}")
    lines = text.split("\n")
    for line in lines:
        if not line.isprintable():
            raise ValueError(f"to_yaml writes comments of printable characters and line "
                             f"breaks only, got {line!r}")
    return [f"# {line}".rstrip() + "\n" for line in lines]
