"""The Kubernetes objects that run the cluster backend's node agents.

:func:`manifest` builds them, :func:`hosts` names the agents for ``ClusterBackend``, and
``phalanx k8s manifest`` (:mod:`phalanx.cli.k8s`) prints them as YAML.

One ``phalanx agent`` runs in every pod, one pod per node; the controller, wherever it runs,
connects to each pod's agent. The manifest is written for a shared cluster: the agents run
as a fixed non-root user, serve TLS, and only the controller's pods (and the agents
themselves) may connect to them. It is up to four objects, printed as YAML documents::

    Secret         NAME-token: a fresh random token under the key "token" (none is printed
                   with --token-secret, which names an existing Secret holding that key)
    Service        NAME, headless (clusterIP: None): it gives every pod the stable DNS name
                   NAME-<i>.NAME.<namespace>.svc.cluster.local and publishes it before the
                   pod is ready, so a controller can resolve agents that are still starting
    NetworkPolicy  NAME (none with --no-network-policy): ingress to the agents' control
                   port from the controller's pods (--controller-selector, in
                   --controller-namespace) and from the agents themselves (tree links,
                   copies of kept results); no rule for the HTTP port, which the kubelet's
                   probes reach from the node (see below)
    StatefulSet    NAME: REPLICAS pods NAME-0 .. NAME-<REPLICAS-1>, started in parallel, at
                   most one per node; each runs
                     phalanx agent --host 0.0.0.0 --port PORT --http-port HTTP_PORT
                                   --store /var/lib/phalanx/store
                                   --tls-cert /etc/phalanx-tls/tls.crt
                                   --tls-key /etc/phalanx-tls/tls.key
                   with the token in $PHALANX_TOKEN (from the Secret), the certificate and
                   key mounted read-only from the kubernetes.io/tls Secret --tls-secret
                   (default NAME-tls), and GET /health on the http port as its readiness
                   and liveness probes

The pods (``securityContext``): user and group ``--run-as-user``/``--run-as-group``
(default 10001, never root; also the ``fsGroup`` that owns their volumes), no privilege
escalation, every capability dropped, the runtime's default seccomp profile, a read-only
root filesystem with emptyDir volumes for what the agent and its ranks write (the code
store, ``/tmp``, ``$HOME``), and no service account token (an agent never talks to the API
server): the ``restricted`` Pod Security Standard.

Why the token comes as ``$PHALANX_TOKEN`` and not as a file: the agent refuses a token file
its group can read, and with ``fsGroup`` set the kubelet makes every file of a Secret volume
group-readable (0440, whatever ``defaultMode`` says: kubernetes/kubernetes#57923); without
``fsGroup`` the file would belong to root, which a non-root agent cannot read. The agent
removes the variable from its environment once it has read it, so no rank inherits it.

``--host 0.0.0.0`` in a pod is the pod's own address (and its loopback): what may reach it
is the NetworkPolicy's business. A policy binds only where the cluster's network plugin
enforces NetworkPolicy (Calico, Cilium, Antrea, ... do; flannel alone does not). The
kubelet's probes come from the node itself, which most plugins admit whatever the policies
say, so the HTTP port (``/health``, ``/metrics``) is admitted to no one else
(``--metrics-selector`` adds a scraper): strangers cannot hold its connections and so fail
the probes. Where a plugin does subject the node's traffic to policies, add a rule
admitting the nodes' addresses (an ``ipBlock``) to the HTTP port.

When to use TLS: always, unless the network is encrypted already. Every frame is
authenticated whatever the network (a relay can neither inject nor alter one), but without
TLS none is encrypted, so whoever can read the pods' traffic reads the calls' arguments,
results and output. The Secret's certificate must name the pods
(``*.NAME.NAMESPACE.svc.cluster.local``) and ``ClusterBackend(tls="ca.pem")`` be given the
CA that signed it. ``--insecure`` leaves TLS off (a warning on stderr and a comment at the
top of the manifest say so): only for a network that is encrypted already (a service
mesh's mTLS, WireGuard between nodes).

On the controller, :func:`hosts` gives the agents' addresses::

    import phalanx as px
    from phalanx.backends.cluster import k8s

    backend = px.ClusterBackend(
        hosts=k8s.hosts("trainer", replicas=4, namespace="ml"),  # trainer-0.trainer.ml...
        token_file="token", tls="ca.pem",
    )

where ``token`` holds the Secret's token, e.g. from ``kubectl -n ml get secret
trainer-token -o jsonpath='{.data.token}' | base64 -d > token`` (a controller running in a
pod takes it as ``$PHALANX_TOKEN`` from the same Secret, as the agents do, and carries the
labels ``--controller-selector`` names). The Service's own name,
``trainer.ml.svc.cluster.local``, resolves to every agent pod at once.

Layer: pure, like ``config``: :func:`manifest`, :func:`notes` and :func:`hosts` are
functions of their arguments (the token aside) that import nothing from phalanx and nothing
outside the standard library, and write nothing. The objects are plain data (dicts, lists,
str, int, bool): :mod:`phalanx.cli.k8s` writes them as YAML, with PyYAML, and prints them.
"""

from __future__ import annotations

import base64
import re
import secrets
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_NAMESPACE = "default"
DEFAULT_PORT = 32300  # the agent's control port; its HTTP port defaults to the next one
CLUSTER_DOMAIN = "cluster.local"  # Kubernetes' default; clusters may be set up otherwise
TOKEN_KEY = "token"  # the token Secret's key
TOKEN_ENV = "PHALANX_TOKEN"  # phalanx.config.ENV_TOKEN (not imported: this module is pure)
TOKEN_BYTES = 32  # of randomness in a generated token (43 URL-safe characters)
TLS_DIR = "/etc/phalanx-tls"  # where the pods mount the kubernetes.io/tls Secret
TLS_SUFFIX = "-tls"  # the TLS Secret's default name is NAME-tls
# The certificate and key in the pod: owned by root, group fsGroup (the kubelet sets both,
# and would add the group's read bit to 0400 anyway), so the agent reads them by its group.
TLS_MODE = 0o440
STORE_DIR = "/var/lib/phalanx"  # an emptyDir: the agent's code store is STORE_DIR/store
HOME_DIR = "/home/phalanx"  # an emptyDir, $HOME: the ranks' caches (~/.cache, ...)
TMP_DIR = "/tmp"  # an emptyDir: tempfile, the debugger's directory
DEFAULT_UID = 10001  # the pods' user and group: not root, not a system account
MAX_ID = 2**31 - 1
APP_NAME = "phalanx-agent"  # app.kubernetes.io/name of every object
CONTAINER_NAME = "agent"
GPU_RESOURCE = "nvidia.com/gpu"
HEALTH_PATH = "/health"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # every namespace carries its own name
NOTE_WIDTH = 86  # characters of a comment's line, after "# "

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
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # a label key's name,
# and a label's value (which may also be empty)
# A Kubernetes quantity without a sign: 8, 0.5, 500m, 64Gi, 1e3
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|[numkMGTPE]|[KMGTPE]i)?")

Selector = str | Mapping[str, str]


def manifest(name: str, replicas: int, image: str, namespace: str = DEFAULT_NAMESPACE,
             port: int = DEFAULT_PORT, http_port: int | None = None,
             token_secret: str | None = None, cpu: str | None = None,
             memory: str | None = None, gpus: int = 0,
             tls_secret: str | None = None, *, insecure: bool = False,
             controller_selector: Selector | None = None,
             controller_namespace: str | None = None,
             metrics_selector: Selector | None = None,
             metrics_namespace: str | None = None, network_policy: bool = True,
             run_as_user: int = DEFAULT_UID,
             run_as_group: int = DEFAULT_UID) -> list[dict[str, Any]]:
    """The Kubernetes objects that run ``replicas`` agents: a Secret with a fresh token
    (unless ``token_secret`` names an existing one), a headless Service, a NetworkPolicy
    (unless not ``network_policy``) and a StatefulSet.

    TLS is on unless ``insecure``: ``tls_secret`` (default ``NAME-tls``) names the
    ``kubernetes.io/tls`` Secret (keys ``tls.crt`` and ``tls.key``) the agents serve TLS
    with; it must exist before the pods can start. The NetworkPolicy admits the pods
    labelled ``controller_selector`` (``"app=trainer,role=ctl"`` or a mapping; required
    with a policy) in ``controller_namespace`` (default: ``namespace``) to the control
    port, and those labelled ``metrics_selector`` (in ``metrics_namespace``) to the HTTP
    port. The pods run as ``run_as_user``:``run_as_group``, never root.

    ``http_port`` defaults to ``port + 1``; ``cpu`` and ``memory`` (quantities such as
    ``"8"``, ``"500m"``, ``"64Gi"``) become each pod's requests and limits, ``gpus`` its
    ``nvidia.com/gpu`` limit. Raises ValueError (TypeError for a value of the wrong type),
    naming the command line option, for any value Kubernetes or the agent would refuse and
    for options that contradict each other; nothing is generated then.
    """
    _check_name(name)
    _check_namespace(namespace, "--namespace")
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
    if token_secret is not None:
        _check_secret(token_secret, "--token-secret")
    _check_flag(insecure, "--insecure")
    if insecure:
        if tls_secret is not None:
            raise ValueError(f"--insecure leaves TLS off, --tls-secret {tls_secret} turns it "
                             f"on: give one of them")
    else:
        tls_secret = f"{name}{TLS_SUFFIX}" if tls_secret is None else tls_secret
        _check_secret(tls_secret, "--tls-secret")
    policy = _network_policy_peers(namespace, network_policy, controller_selector,
                                   controller_namespace, metrics_selector, metrics_namespace)
    _check_id(run_as_user, "--run-as-user")
    _check_id(run_as_group, "--run-as-group")
    resources = _resources(cpu, memory, gpus)

    labels = {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": name}
    objects = []
    if token_secret is None:
        token_secret = f"{name}-{TOKEN_KEY}"
        objects.append(_secret(token_secret, namespace, labels))
    objects.append(_service(name, namespace, labels, port, http_port))
    if policy is not None:
        controllers, scrapers = policy
        objects.append(_network_policy(name, namespace, labels, port, http_port, controllers,
                                       scrapers))
    objects.append(_stateful_set(name, replicas, image, namespace, labels, port, http_port,
                                 token_secret, resources, tls_secret, run_as_user,
                                 run_as_group))
    return objects


def hosts(name: str, replicas: int, namespace: str = DEFAULT_NAMESPACE,
          port: int = DEFAULT_PORT, domain: str = CLUSTER_DOMAIN) -> list[str]:
    """The agents' addresses, ``NAME-<i>.NAME.NAMESPACE.svc.DOMAIN:PORT`` for each pod of
    :func:`manifest`'s StatefulSet, in pod order: ``ClusterBackend(hosts=...)``."""
    _check_name(name)
    _check_namespace(namespace, "--namespace")
    _check_integer(replicas, "--replicas", low=1)
    _check_port(port, "--port")
    return [f"{name}-{i}.{name}.{namespace}.svc.{domain}:{port}" for i in range(replicas)]


def notes(objects: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """What a reader of :func:`manifest`'s ``objects`` should know, one note (or None) for
    each, for :func:`phalanx.cli.k8s.to_yaml`'s ``comments``: the first says so when TLS is
    off, the StatefulSet's which TLS Secret the pods wait for, the NetworkPolicy's whom it
    admits and why the probes still pass."""
    found: list[str | None] = [None] * len(objects)
    head: list[str] = []
    for i, obj in enumerate(objects):
        kind = obj.get("kind")
        if kind == "StatefulSet":
            tls = _tls_secret_of(obj)
            meta = obj["metadata"]
            if tls is None:
                head.append(INSECURE_NOTE)
            else:
                found[i] = TLS_NOTE.format(secret=tls, namespace=meta["namespace"],
                                           name=meta["name"])
        elif kind == "NetworkPolicy":
            found[i] = _policy_note(obj)
    if head and objects:
        found[0] = "\n".join(head + ([found[0]] if found[0] else []))
    return found


INSECURE_NOTE = """\
WARNING: generated with --insecure: the agents serve plain TCP, without TLS.
Every frame is authenticated, but none is encrypted: whoever can read the pods'
traffic reads every call's arguments, results and output. Apply it only where the
network is encrypted already (a service mesh's mTLS, WireGuard between nodes)."""

TLS_NOTE = """\
TLS: the pods mount the kubernetes.io/tls Secret {secret} and do not start until it
exists. Its certificate must name *.{name}.{namespace}.svc.cluster.local, e.g.
  kubectl -n {namespace} create secret tls {secret} --cert agents.crt --key agents.key
and the controller trusts the CA that signed it: px.ClusterBackend(..., tls="ca.pem")."""


def _policy_note(policy: Mapping[str, Any]) -> str:
    rules = policy["spec"]["ingress"]
    control, *http = rules
    paragraphs = [
        f"Only the controller's pods ({_describe(control['from'][0])}) and the agents "
        f"themselves (tree links, copies of kept results) may connect to the control port "
        f"{control['ports'][0]['port']}.",
        (f"The HTTP port {http[0]['ports'][0]['port']} (/health, /metrics) admits "
         f"{_describe(http[0]['from'][0])} only." if http else
         "No rule admits anyone to the HTTP port (/health, /metrics)."),
        "The kubelet's liveness and readiness probes come from the node itself, which most "
        "network plugins (Calico, Cilium, ...) do not subject to NetworkPolicy: they pass "
        "while strangers cannot reach the port. Where yours does, and the probes fail, add "
        "a rule admitting the nodes' addresses (ipBlock) to the HTTP port. A policy binds "
        "only where the cluster's network plugin enforces NetworkPolicy.",
    ]
    return "\n".join(textwrap.fill(text, NOTE_WIDTH, break_long_words=False,
                                   break_on_hyphens=False) for text in paragraphs)


def _describe(peer: Mapping[str, Any]) -> str:
    """A policy peer as a reader would write it: ``app=trainer in namespace ml``."""
    labels = ",".join(f"{k}={v}" for k, v in peer["podSelector"]["matchLabels"].items())
    namespace = peer.get("namespaceSelector", {}).get("matchLabels", {}).get(NAMESPACE_LABEL)
    return labels if namespace is None else f"{labels} in namespace {namespace}"


def _tls_secret_of(stateful_set: Mapping[str, Any]) -> str | None:
    for volume in stateful_set["spec"]["template"]["spec"].get("volumes", []):
        if volume.get("name") == "tls":
            return str(volume["secret"]["secretName"])
    return None


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


def _network_policy(name: str, namespace: str, labels: dict[str, str], port: int,
                    http_port: int, controllers: dict[str, Any],
                    scrapers: dict[str, Any] | None) -> dict[str, Any]:
    # Ingress only: the agents reach each other (and DNS) as they need. The kubelet's probes
    # are not subject to policies in most network plugins (see the module docstring), so no
    # rule admits them; the HTTP port admits only the --metrics-selector pods.
    ingress: list[dict[str, Any]] = [{
        "from": [controllers, {"podSelector": {"matchLabels": dict(labels)}}],
        "ports": [{"protocol": "TCP", "port": port}],
    }]
    if scrapers is not None:
        ingress.append({"from": [scrapers], "ports": [{"protocol": "TCP", "port": http_port}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "podSelector": {"matchLabels": dict(labels)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _peer(selector: dict[str, str], namespace: str | None) -> dict[str, Any]:
    """A NetworkPolicy peer: the pods labelled ``selector`` in ``namespace`` (None: the
    policy's own)."""
    peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(selector)}}
    if namespace is not None:
        peer["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: namespace}}
    return peer


def _network_policy_peers(namespace: str, network_policy: bool,
                          controller_selector: Selector | None,
                          controller_namespace: str | None,
                          metrics_selector: Selector | None, metrics_namespace: str | None,
                          ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """The policy's peers (the controllers, the scrapers or None); None without a policy."""
    _check_flag(network_policy, "--no-network-policy")
    given = [option for option, value in (
        ("--controller-selector", controller_selector),
        ("--controller-namespace", controller_namespace),
        ("--metrics-selector", metrics_selector),
        ("--metrics-namespace", metrics_namespace)) if value is not None]
    if not network_policy:
        if given:
            raise ValueError(f"{given[0]} shapes the NetworkPolicy, and --no-network-policy "
                             f"leaves it out: give one of them")
        return None
    if controller_selector is None:
        raise ValueError("--controller-selector is required: the labels of the controller's "
                         "pods, such as app=trainer, which alone (with the agents) may "
                         "connect to the agents; or --no-network-policy to print no "
                         "NetworkPolicy (anything that reaches the pods may then connect)")
    controllers = _parse_selector(controller_selector, "--controller-selector")
    if controller_namespace is not None:
        _check_namespace(controller_namespace, "--controller-namespace")
    scrapers = None
    if metrics_selector is not None:
        scrapers = _parse_selector(metrics_selector, "--metrics-selector")
    if metrics_namespace is not None:
        if metrics_selector is None:
            raise ValueError("--metrics-namespace needs --metrics-selector: the labels of "
                             "the pods admitted to the HTTP port")
        _check_namespace(metrics_namespace, "--metrics-namespace")

    def where(other: str | None) -> str | None:
        return None if other is None or other == namespace else other

    return (_peer(controllers, where(controller_namespace)),
            None if scrapers is None else _peer(scrapers, where(metrics_namespace)))


def _stateful_set(name: str, replicas: int, image: str, namespace: str,
                  labels: dict[str, str], port: int, http_port: int, token_secret: str,
                  resources: dict[str, Any], tls_secret: str | None, uid: int,
                  gid: int) -> dict[str, Any]:
    command = ["phalanx", "agent", "--host", "0.0.0.0", "--port", str(port),
               "--http-port", str(http_port), "--store", f"{STORE_DIR}/store"]
    env = [
        # the agent reads it, then removes it from its environment: no rank inherits it
        {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": token_secret,
                                                           "key": TOKEN_KEY}}},
        {"name": "HOME", "value": HOME_DIR},
    ]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if tls_secret is not None:
        command += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
        volumes.append({"name": "tls", "secret": {
            "secretName": tls_secret,
            "items": [{"key": "tls.crt", "path": "tls.crt"},
                      {"key": "tls.key", "path": "tls.key"}],
            "defaultMode": TLS_MODE,
        }})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    # the root filesystem is read-only: what the agent and its ranks write goes here
    for volume, path in (("store", STORE_DIR), ("tmp", TMP_DIR), ("home", HOME_DIR)):
        volumes.append({"name": volume, "emptyDir": {}})
        mounts.append({"name": volume, "mountPath": path})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": command,
        "env": env,
        "ports": [
            {"name": "control", "containerPort": port, "protocol": "TCP"},
            {"name": "http", "containerPort": http_port, "protocol": "TCP"},
        ],
        # Plain HTTP even with TLS on (the agent serves /health without it). Strangers
        # cannot reach the port under the NetworkPolicy; the agent's HTTP server also
        # bounds what one client may hold.
        "readinessProbe": {"httpGet": {"path": HEALTH_PATH, "port": "http"},
                           **READINESS_PROBE},
        "livenessProbe": {"httpGet": {"path": HEALTH_PATH, "port": "http"},
                          **LIVENESS_PROBE},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
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
                    # an agent never calls the API server: no credentials for one to steal
                    "automountServiceAccountToken": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": uid,
                        "runAsGroup": gid,
                        "fsGroup": gid,  # owns the volumes: the TLS key, the emptyDirs
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
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


def _check_namespace(namespace: str, option: str) -> None:
    if not isinstance(namespace, str):
        raise TypeError(f"{option} must be a string, got {type(namespace).__name__}")
    if not (_LABEL.fullmatch(namespace) and len(namespace) <= 63):
        raise ValueError(f"{option} must be a namespace, a DNS label: lowercase letters, "
                         f"digits and '-', starting and ending with a letter or digit, at "
                         f"most 63 characters; got {namespace!r}")


def _check_secret(name: object, option: str) -> None:
    if not (isinstance(name, str) and len(name) <= 253 and _SUBDOMAIN.fullmatch(name)):
        raise ValueError(f"{option} must name a Secret: lowercase letters, digits, '-' and "
                         f"'.', at most 253 characters, starting and ending with a letter "
                         f"or digit; got {name!r}")


def _parse_selector(selector: Selector, option: str) -> dict[str, str]:
    """``KEY=VALUE[,KEY=VALUE...]`` (or a mapping) as a label selector's matchLabels."""
    example = f"{option} must be labels KEY=VALUE[,KEY=VALUE...], such as app=trainer"
    if isinstance(selector, str):
        pairs = []
        for part in selector.split(","):
            key, equals, value = part.strip().partition("=")
            if not equals or value.startswith("=") or key.endswith("!"):
                raise ValueError(f"{example} (a NetworkPolicy matches labels by equality "
                                 f"only); got {selector!r}")
            pairs.append((key.strip(), value.strip()))
    elif isinstance(selector, Mapping):
        pairs = list(selector.items())
    else:
        raise TypeError(f"{option} must be a string or a mapping, got "
                        f"{type(selector).__name__}")
    if not pairs:
        raise ValueError(f"{example}: it must name at least one label (an empty selector "
                         f"matches every pod)")
    labels: dict[str, str] = {}
    for key, value in pairs:
        if not (isinstance(key, str) and isinstance(value, str)):
            raise TypeError(f"{option}'s labels must be strings, got {key!r}: {value!r}")
        prefix, slash, base = key.rpartition("/")
        if not (_LABEL_NAME.fullmatch(base) and len(base) <= 63
                and (not slash or (_SUBDOMAIN.fullmatch(prefix) and len(prefix) <= 253))):
            raise ValueError(f"{example}: {key!r} is not a label key (an optional DNS prefix "
                             f"and '/', then at most 63 letters, digits, '-', '_' and '.', "
                             f"starting and ending with a letter or digit)")
        if value and not (_LABEL_NAME.fullmatch(value) and len(value) <= 63):
            raise ValueError(f"{example}: {value!r} (of {key}) is not a label value (at most "
                             f"63 letters, digits, '-', '_' and '.', starting and ending "
                             f"with a letter or digit)")
        if key in labels:
            raise ValueError(f"{example}: {key} is given twice")
        labels[key] = value
    return labels


def _check_flag(value: bool, option: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{option} is a flag: True or False, got {value!r}")


def _check_id(value: int, option: str) -> None:
    _check_integer(value, option, low=0)
    if value == 0:
        raise ValueError(f"{option} must not be 0: the agents never run as root")
    if value > MAX_ID:
        raise ValueError(f"{option} must be at most {MAX_ID}, got {value}")


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
