"""Kubernetes manifests for the cluster backend's node agents: ``phalanx k8s manifest``.

One ``phalanx agent`` runs in every pod, one pod per node; the controller, wherever it runs,
connects to each pod's agent. The manifest is three objects, printed as YAML documents::

    Secret       NAME-token: a fresh random token under the key "token" (none is printed
                 with --token-secret, which names an existing Secret holding that key)
    Service      NAME, headless (clusterIP: None): it gives every pod the stable DNS name
                 NAME-<i>.NAME.<namespace>.svc.cluster.local and publishes it before the
                 pod is ready, so a controller can resolve agents that are still starting
    StatefulSet  NAME: REPLICAS pods NAME-0 .. NAME-<REPLICAS-1>, started in parallel, at
                 most one per node; each runs
                   phalanx agent --host 0.0.0.0 --port PORT --http-port HTTP_PORT
                                 --token-file /etc/phalanx/token
                 with the Secret mounted read-only at /etc/phalanx (the token file at mode
                 0400, since the agent refuses a token file its group or others can read)
                 and GET /health on the http port as its readiness and liveness probes;
                 with --tls-secret, also --tls-cert and --tls-key from that Secret

When to use TLS: every frame is authenticated whatever the network (a relay can neither
inject nor alter one), but without TLS none is encrypted, so whoever can read the pods'
traffic reads the calls' arguments, results and output. On a cluster network others can
sniff (no encryption between nodes, other tenants on the same nodes, a Service reachable
from outside the cluster), give ``--tls-secret`` a ``kubernetes.io/tls`` Secret whose
certificate names the pods (``*.NAME.NAMESPACE.svc.cluster.local``), and
``ClusterBackend(tls="ca.pem")`` the CA that signed it; on a network that is encrypted
already (a service mesh's mTLS, WireGuard between nodes) the token and the frame MACs are
enough.

On the controller, :func:`hosts` gives the agents' addresses::

    import phalanx as px
    from phalanx import k8s

    backend = px.ClusterBackend(
        hosts=k8s.hosts("trainer", replicas=4, namespace="ml"),  # trainer-0.trainer.ml...
        token_file="token",
    )

where ``token`` holds the Secret's token, e.g. from ``kubectl -n ml get secret
trainer-token -o jsonpath='{.data.token}' | base64 -d > token`` (a controller running in a
pod mounts the same Secret instead). The Service's own name,
``trainer.ml.svc.cluster.local``, resolves to every agent pod at once.

Layer: pure, like ``config``: :func:`manifest`, :func:`hosts` and :func:`to_yaml` are
functions of their arguments (the token aside) that import nothing from phalanx and nothing
outside the standard library (no PyYAML: the core does not depend on it); only
:func:`main` writes, to stdout and stderr.
"""

from __future__ import annotations

import argparse
import base64
import re
import secrets
import sys
from typing import Any

USAGE_ERROR = 2  # the exit status for a bad command line, as phalanx.cli.main's

DEFAULT_NAMESPACE = "default"
DEFAULT_PORT = 32300  # the agent's control port; its HTTP port defaults to the next one
CLUSTER_DOMAIN = "cluster.local"  # Kubernetes' default; clusters may be set up otherwise
TOKEN_DIR = "/etc/phalanx"  # where the pods mount the Secret
TOKEN_KEY = "token"  # the Secret's key, and so the file's name under TOKEN_DIR
TOKEN_BYTES = 32  # of randomness in a generated token (43 URL-safe characters)
# The token file's mode in the pod: Kubernetes' default (0644) would be refused by the agent.
# The file belongs to root: the agent runs as root (the image's default) to read it.
TOKEN_MODE = 0o400
TLS_DIR = "/etc/phalanx-tls"  # where the pods mount a kubernetes.io/tls Secret (--tls-secret)
APP_NAME = "phalanx-agent"  # app.kubernetes.io/name of every object
CONTAINER_NAME = "agent"
GPU_RESOURCE = "nvidia.com/gpu"
HEALTH_PATH = "/health"

# Readiness only says "this agent answers" (DNS publishes the pod either way): probe often.
READINESS_PROBE = {"periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 3}
# A liveness failure restarts the container, and so kills every rank the agent runs: only
# after a minute of silence, never for one slow answer from an agent busy with a job.
LIVENESS_PROBE = {"initialDelaySeconds": 10, "periodSeconds": 10, "timeoutSeconds": 5,
                  "failureThreshold": 6}

# The StatefulSet controller labels each pod "controller-revision-hash: NAME-<hash of up to
# 10 characters>", a label value of at most 63 characters: longer names make pods that
# Kubernetes refuses to create.
MAX_NAME = 52
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # DNS-1123 label
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# A Kubernetes quantity without a sign: 8, 0.5, 500m, 64Gi, 1e3
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|[numkMGTPE]|[KMGTPE]i)?")


def manifest(name: str, replicas: int, image: str, namespace: str = DEFAULT_NAMESPACE,
             port: int = DEFAULT_PORT, http_port: int | None = None,
             token_secret: str | None = None, cpu: str | None = None,
             memory: str | None = None, gpus: int = 0,
             tls_secret: str | None = None) -> list[dict[str, Any]]:
    """The Kubernetes objects that run ``replicas`` agents: a Secret with a fresh token
    (unless ``token_secret`` names an existing one), a headless Service and a StatefulSet.
    ``tls_secret`` names an existing ``kubernetes.io/tls`` Secret (keys ``tls.crt`` and
    ``tls.key``): the agents serve TLS with it.

    ``http_port`` defaults to ``port + 1``; ``cpu`` and ``memory`` (quantities such as
    ``"8"``, ``"500m"``, ``"64Gi"``) become each pod's requests and limits, ``gpus`` its
    ``nvidia.com/gpu`` limit. Raises ValueError, naming the command line option, for any
    value Kubernetes or the agent would refuse; nothing is generated then.
    """
    _check_name(name)
    _check_namespace(namespace)
    _check_integer(replicas, "--replicas", low=1)
    if not isinstance(image, str):
        raise TypeError(f"--image must be a string, got {type(image).__name__}")
    if not image or any(c.isspace() for c in image):
        raise ValueError(f"--image must name a container image, such as "
                         f"registry.example.com/phalanx:0.1, got {image!r}")
    _check_port(port, "--port")
    if http_port is None:
        if port == 65535:
            raise ValueError("--http-port defaults to --port + 1, and --port is 65535: give "
                             "--http-port")
        http_port = port + 1
    _check_port(http_port, "--http-port")
    if http_port == port:
        raise ValueError(f"--http-port must differ from --port, both are {port}")
    if token_secret is not None and not _is_subdomain(token_secret):
        raise ValueError(f"--token-secret must name a Secret: lowercase letters, digits, '-' "
                         f"and '.', at most 253 characters, starting and ending with a letter "
                         f"or digit; got {token_secret!r}")
    if tls_secret is not None and not _is_subdomain(tls_secret):
        raise ValueError(f"--tls-secret must name a Secret: lowercase letters, digits, '-' "
                         f"and '.', at most 253 characters, starting and ending with a letter "
                         f"or digit; got {tls_secret!r}")
    resources = _resources(cpu, memory, gpus)

    labels = {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": name}
    objects = []
    if token_secret is None:
        token_secret = f"{name}-{TOKEN_KEY}"
        objects.append(_secret(token_secret, namespace, labels))
    objects.append(_service(name, namespace, labels, port, http_port))
    objects.append(_stateful_set(name, replicas, image, namespace, labels, port, http_port,
                                 token_secret, resources, tls_secret))
    return objects


def hosts(name: str, replicas: int, namespace: str = DEFAULT_NAMESPACE,
          port: int = DEFAULT_PORT, domain: str = CLUSTER_DOMAIN) -> list[str]:
    """The agents' addresses, ``NAME-<i>.NAME.NAMESPACE.svc.DOMAIN:PORT`` for each pod of
    :func:`manifest`'s StatefulSet, in pod order: ``ClusterBackend(hosts=...)``."""
    _check_name(name)
    _check_namespace(namespace)
    _check_integer(replicas, "--replicas", low=1)
    _check_port(port, "--port")
    return [f"{name}-{i}.{name}.{namespace}.svc.{domain}:{port}" for i in range(replicas)]


def _secret(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    token = secrets.token_urlsafe(TOKEN_BYTES)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _service(name: str, namespace: str, labels: dict[str, str], port: int,
             http_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",
            # agents are reachable by name while they start, and while one fails a probe
            "publishNotReadyAddresses": True,
            "selector": dict(labels),
            "ports": [
                {"name": "control", "port": port, "targetPort": "control", "protocol": "TCP"},
                {"name": "http", "port": http_port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def _stateful_set(name: str, replicas: int, image: str, namespace: str,
                  labels: dict[str, str], port: int, http_port: int, token_secret: str,
                  resources: dict[str, Any], tls_secret: str | None = None) -> dict[str, Any]:
    command = ["phalanx", "agent", "--host", "0.0.0.0", "--port", str(port),
               "--http-port", str(http_port), "--token-file", f"{TOKEN_DIR}/{TOKEN_KEY}"]
    volumes: list[dict[str, Any]] = [{"name": "token", "secret": {
        "secretName": token_secret,
        # only the token, whatever else an existing Secret holds
        "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
        "defaultMode": TOKEN_MODE,
    }}]
    mounts = [{"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}]
    if tls_secret is not None:
        command += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
        volumes.append({"name": "tls", "secret": {
            "secretName": tls_secret,
            "items": [{"key": "tls.crt", "path": "tls.crt"},
                      {"key": "tls.key", "path": "tls.key"}],
            "defaultMode": TOKEN_MODE,
        }})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": command,
        "ports": [
            {"name": "control", "containerPort": port, "protocol": "TCP"},
            {"name": "http", "containerPort": http_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": HEALTH_PATH, "port": "http"},
                           **READINESS_PROBE},
        "livenessProbe": {"httpGet": {"path": HEALTH_PATH, "port": "http"},
                          **LIVENESS_PROBE},
        "volumeMounts": mounts,
    }
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            # all agents start at once: the default (one pod after the other, each waiting
            # for the previous one to be ready) makes a cluster's start grow with its size
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    # one agent per node: each supervises its whole node (GPUs, processes)
                    "affinity": {"podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [{
                            "labelSelector": {"matchLabels": dict(labels)},
                            "topologyKey": "kubernetes.io/hostname",
                        }],
                    }},
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _resources(cpu: str | None, memory: str | None, gpus: int) -> dict[str, Any]:
    """Requests equal to limits (the Guaranteed class: a job's pods are not the first to be
    evicted); GPUs as limits only, which Kubernetes copies to the requests."""
    amounts: dict[str, Any] = {}
    for option, resource, value in (("--cpu", "cpu", cpu), ("--memory", "memory", memory)):
        if value is not None:
            _check_quantity(value, option)
            amounts[resource] = value
    _check_integer(gpus, "--gpus", low=0)
    resources: dict[str, Any] = {}
    if amounts:
        resources = {"requests": dict(amounts), "limits": dict(amounts)}
    if gpus:
        resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
    return resources


def _check_name(name: str) -> None:
    # The Service is named NAME too, and a Service name must start with a letter (DNS-1035).
    if not isinstance(name, str):
        raise TypeError(f"--name must be a string, got {type(name).__name__}")
    if not (_LABEL.fullmatch(name) and name[0].isalpha() and len(name) <= MAX_NAME):
        raise ValueError(f"--name must be a DNS label: lowercase letters, digits and '-', "
                         f"starting with a letter, ending with a letter or digit, at most "
                         f"{MAX_NAME} characters (pods add their own suffixes); got {name!r}")


def _check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str):
        raise TypeError(f"--namespace must be a string, got {type(namespace).__name__}")
    if not (_LABEL.fullmatch(namespace) and len(namespace) <= 63):
        raise ValueError(f"--namespace must be a DNS label: lowercase letters, digits and "
                         f"'-', starting and ending with a letter or digit, at most 63 "
                         f"characters; got {namespace!r}")


def _is_subdomain(name: object) -> bool:
    return isinstance(name, str) and len(name) <= 253 and bool(_SUBDOMAIN.fullmatch(name))


def _check_integer(value: int, option: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{option} must be at least {low}, got {value}")


def _check_port(value: int, option: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} must be an integer, got {value!r}")
    if not 0 < value < 65536:
        raise ValueError(f"{option} must be a port in 1-65535, got {value}")


def _check_quantity(value: str, option: str) -> None:
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if match is None or float(match.group(1)) == 0:
        raise ValueError(f"{option} must be a positive Kubernetes quantity, such as 8, 500m "
                         f"or 64Gi; got {value!r}")


# -- YAML ---------------------------------------------------------------------------------

# Strings written without quotes: letters, digits and "_./-", starting with a letter or "/",
# and none of the words that a YAML 1.1 reader (PyYAML, and the Go library kubectl uses)
# takes for a boolean or null. Everything else is double-quoted; that is always correct,
# just less pretty ("500m" is quoted because a string starting with a digit may be a
# number, a time or a sexagesimal integer).
_PLAIN = re.compile(r"[A-Za-z/][A-Za-z0-9_./-]*")
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\0": "\\0"}
MAX_KEY = 1024  # characters: YAML's limit on a key written on its own line, quotes included


def to_yaml(objects: list[Any]) -> str:
    """``objects`` as YAML documents separated by ``---`` lines, in block style.

    Only plain data: dicts with string keys, lists, str, int, bool and None; anything else
    raises TypeError. A YAML 1.1 or 1.2 reader gives back exactly ``objects``.
    """
    return "---\n".join("\n".join(_lines(obj, 0)) + "\n" for obj in objects)


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict) and value:
        lines = []
        for key, item in value.items():
            head = f"{pad}{_key(key)}:"
            if isinstance(item, (dict, list)) and item:
                lines.append(head)
                lines.extend(_lines(item, indent + 2))
            else:
                lines.append(f"{head} {_scalar(item)}")
        return lines
    if isinstance(value, list) and value:
        lines = []
        for item in value:
            if isinstance(item, (dict, list)) and item:
                # the item's first line goes after its dash: "- name: x", "- - 1"
                nested = _lines(item, indent + 2)
                nested[0] = f"{pad}- {nested[0][indent + 2:]}"
                lines.extend(nested)
            else:
                lines.append(f"{pad}- {_scalar(item)}")
        return lines
    return [pad + _scalar(value)]


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"to_yaml writes string keys only, got {key!r}")
    text = _string(key)
    if len(text) > MAX_KEY:
        raise ValueError(f"to_yaml writes keys of at most {MAX_KEY} characters, got one of "
                         f"{len(text)}: {key[:40]!r}...")
    return text


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))  # an IntEnum would print its name
    if isinstance(value, str):
        return _string(value)
    if value == {} and isinstance(value, dict):
        return "{}"
    if value == [] and isinstance(value, list):
        return "[]"
    raise TypeError(f"to_yaml writes dicts, lists, str, int, bool and None only, got "
                    f"{type(value).__name__} {value!r}")


def _string(text: str) -> str:
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED:
        return text
    return '"' + "".join(_escape(c) for c in text) + '"'


def _escape(char: str) -> str:
    if char in _ESCAPES:
        return _ESCAPES[char]
    code = ord(char)
    # YAML's printable characters, less the line breaks NEL, LS and PS (a double-quoted
    # scalar folds line breaks into spaces) and the byte order mark
    if (0x20 <= code <= 0x7E or (0xA0 <= code <= 0xD7FF and code not in (0x2028, 0x2029))
            or (0xE000 <= code <= 0xFFFD and code != 0xFEFF) or 0x10000 <= code <= 0x10FFFF):
        return char
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


# -- command line -------------------------------------------------------------------------

MANIFEST_DESCRIPTION = """\
Print the Kubernetes objects that run one phalanx agent per node, as YAML for
kubectl apply -f -: a Secret holding a fresh random token (unless --token-secret names an
existing one), a headless Service NAME giving the pods stable DNS names, and a StatefulSet
NAME of REPLICAS pods (at most one per node), each running
  phalanx agent --host 0.0.0.0 --port PORT --http-port HTTP_PORT --token-file
                /etc/phalanx/token
with GET /health on the http port as its readiness and liveness probes.

Frames are authenticated on any network, not encrypted: where others can read the pods'
traffic, give --tls-secret a kubernetes.io/tls Secret (certificate for
*.NAME.NAMESPACE.svc.cluster.local) and the backend tls="ca.pem".
"""

MANIFEST_EPILOG = """\
the controller connects to the pods by name:
  px.ClusterBackend(hosts=phalanx.backends.cluster.k8s.hosts(NAME, REPLICAS, NAMESPACE, PORT),
                    token_file=...)
  that is NAME-0.NAME.NAMESPACE.svc.cluster.local:PORT, NAME-1..., with the token from
  kubectl -n NAMESPACE get secret NAME-token -o jsonpath='{.data.token}' | base64 -d

exit status:
  0        the manifest was printed
  2        bad command line (nothing is printed)

examples:
  phalanx k8s manifest --name trainer --replicas 4 --image registry.example.com/app:1.0 \\
      --namespace ml --cpu 16 --memory 64Gi --gpus 8 | kubectl apply -f -
  phalanx k8s manifest --name trainer --replicas 2 --image app:1.0 --token-secret mine
  phalanx k8s manifest --name trainer --replicas 2 --image app:1.0 --tls-secret trainer-tls
"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``k8s manifest`` to the ``phalanx`` parser's subcommands (``commands``, from its
    ``add_subparsers()``); the parsed options carry ``func=main``."""
    k8s = commands.add_parser(
        "k8s",
        help="Kubernetes manifests that run the cluster backend's agents",
        description="Kubernetes manifests that run the cluster backend's agents.",
    )
    k8s.set_defaults(func=main)
    actions = k8s.add_subparsers(dest="k8s_command", metavar="ACTION")
    actions.required = True
    parser = actions.add_parser(
        "manifest",
        help="print a Secret, a headless Service and a StatefulSet of agents as YAML",
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
    parser.add_argument("--tls-secret", metavar="SECRET",
                        help="an existing kubernetes.io/tls Secret: the agents serve TLS with "
                             "its tls.crt and tls.key (use it where others can read the "
                             "pods' traffic)")
    parser.add_argument("--cpu", metavar="QUANTITY",
                        help="CPU request and limit of each pod, e.g. 16 or 500m")
    parser.add_argument("--memory", metavar="QUANTITY",
                        help="memory request and limit of each pod, e.g. 64Gi")
    parser.add_argument("--gpus", type=int, default=0, metavar="G",
                        help=f"{GPU_RESOURCE} limit of each pod (default: none)")
    return k8s


def main(options: argparse.Namespace) -> int:
    """Run ``phalanx k8s ...``; the exit status."""
    if options.k8s_command != "manifest":  # pragma: no cover - argparse checks
        print(f"phalanx k8s: unknown action {options.k8s_command!r}", file=sys.stderr)
        return USAGE_ERROR
    try:
        text = to_yaml(manifest(
            options.name, options.replicas, options.image, namespace=options.namespace,
            port=options.port, http_port=options.http_port, token_secret=options.token_secret,
            cpu=options.cpu, memory=options.memory, gpus=options.gpus,
            tls_secret=options.tls_secret))
    except ValueError as exc:
        print(f"phalanx k8s manifest: {exc}", file=sys.stderr)
        return USAGE_ERROR
    sys.stdout.write(text)
    return 0
