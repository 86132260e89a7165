"""``phalanx k8s manifest``: the objects it prints, checked offline.

No Kubernetes API server is available here (no cluster, no kubeconfig: ``kubectl apply``,
even ``--dry-run=server``, cannot run), so nothing is applied. Instead the objects are
validated against Kubernetes' own OpenAPI schemas (bundled with ``kubernetes-validate``,
strict: an unknown field is an error), checked against the ``restricted`` Pod Security
Standard's rules (written out below, as the API server's admission would apply them), and
the YAML the command prints (PyYAML's, :func:`phalanx.cli.k8s.to_yaml`) is read back with
PyYAML. The command line is driven through a fresh ``argparse`` parser built by
``phalanx.cli.k8s.add_parser``, the way ``phalanx``'s own parser includes it, and the
agent's command in the pods is parsed by ``phalanx agent``'s own parser.
"""

from __future__ import annotations

import argparse
import base64
import re
import string
import subprocess
import sys

import pytest
import yaml as pyyaml
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx import config
from phalanx.backends.cluster import k8s
from phalanx.cli import k8s as k8s_cli
from phalanx.cli import main as cli

K8S_VERSION = "1.30"  # the schemas the objects are checked against

CONTROLLER = "app=trainer-controller"
FULL = dict(name="trainer", replicas=4, image="registry.example.com/app:1.0", namespace="ml",
            port=40000, http_port=40100, cpu="16", memory="64Gi", gpus=8,
            controller_selector=CONTROLLER)
VARIANTS = {
    "defaults": dict(name="agents", replicas=1, image="app", controller_selector="app=ctl"),
    "all options": FULL,
    "token secret": dict(FULL, token_secret="team.phalanx-token"),
    "tls secret": dict(FULL, tls_secret="agents-tls"),
    "insecure": dict(FULL, insecure=True),
    "no network policy": dict(name="a1", replicas=2, image="app", network_policy=False),
    "insecure, no policy": dict(name="a1", replicas=2, image="app", network_policy=False,
                                insecure=True),
    "other namespaces": dict(FULL, controller_namespace="jobs",
                             metrics_selector="app.kubernetes.io/name=prometheus",
                             metrics_namespace="monitoring"),
    "ids": dict(FULL, run_as_user=2000, run_as_group=3000),
    "cpu only": dict(name="a1", replicas=2, image="app", cpu="500m", controller_selector="a=b"),
    "gpus only": dict(name="a1", replicas=2, image="app", gpus=1, controller_selector="a=b"),
}
REQUIRED = ["--name", "trainer", "--replicas", "2", "--image", "app",
            "--controller-selector", CONTROLLER]


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip(
        "kubernetes_validate",
        reason="validating against Kubernetes' schemas needs kubernetes-validate "
               "(pip install 'phalanx[test]')")


@pytest.fixture(scope="module")
def yaml():
    """PyYAML, which reads the manifests back (phalanx depends on it: it writes them)."""
    return pyyaml


def by_kind(objects: list[dict]) -> dict[str, dict]:
    kinds = [obj["kind"] for obj in objects]
    assert len(set(kinds)) == len(kinds), kinds
    return {obj["kind"]: obj for obj in objects}


def pod(objects: list[dict]) -> dict:
    return by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]


def container(objects: list[dict]) -> dict:
    (agent,) = pod(objects)["containers"]
    return agent


def flag(command: list[str], name: str) -> str | None:
    """The value after ``name`` in ``command`` (None when it is not there)."""
    return command[command.index(name) + 1] if name in command else None


def phalanx_k8s(*args: str) -> int:
    """``phalanx k8s ARGS...`` through a fresh top-level parser; its exit status."""
    parser = argparse.ArgumentParser(prog="phalanx")
    k8s_cli.add_parser(parser.add_subparsers(dest="command"))
    try:
        options = parser.parse_args(["k8s", *args])
    except SystemExit as exc:  # argparse's own refusal (not an integer, a missing option)
        return exc.code
    return options.func(options)


# -- the objects ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_objects_validate_against_the_kubernetes_schemas(variant, kubernetes_validate):
    options = VARIANTS[variant]
    objects = k8s.manifest(**options)
    assert [obj["kind"] for obj in objects] == (
        ([] if "token_secret" in options else ["Secret"]) + ["Service"]
        + ([] if options.get("network_policy") is False else ["NetworkPolicy"])
        + ["StatefulSet"])
    for obj in objects:
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == K8S_VERSION


def test_the_validator_refuses_a_broken_object(kubernetes_validate):
    """The check above can fail: a wrong type and an unknown field are caught."""
    stateful_set = by_kind(k8s.manifest(**FULL))["StatefulSet"]
    stateful_set["spec"]["replicas"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(stateful_set, K8S_VERSION, strict=True)
    service = by_kind(k8s.manifest(**FULL))["Service"]
    service["spec"]["headless"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, K8S_VERSION, strict=True)


def test_a_headless_service_and_a_parallel_stateful_set_select_the_pods():
    kinds = by_kind(k8s.manifest(**FULL))
    service, stateful_set = kinds["Service"], kinds["StatefulSet"]
    labels = {"app.kubernetes.io/name": "phalanx-agent", "app.kubernetes.io/instance": "trainer"}
    assert service["metadata"]["name"] == stateful_set["metadata"]["name"] == "trainer"
    assert all(obj["metadata"]["namespace"] == "ml" for obj in kinds.values())
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {
        ("control", 40000), ("http", 40100)}
    spec = stateful_set["spec"]
    assert (spec["serviceName"], spec["replicas"], spec["podManagementPolicy"]) == (
        "trainer", 4, "Parallel")
    pod_labels = spec["template"]["metadata"]["labels"]
    assert pod_labels == labels
    assert spec["selector"]["matchLabels"] == service["spec"]["selector"] == labels


def test_the_container_runs_the_agent_on_both_ports_with_tls():
    agent = container(k8s.manifest(**FULL))
    assert agent["image"] == "registry.example.com/app:1.0"
    assert agent["command"] == ["phalanx", "agent", "--host", "0.0.0.0", "--port", "40000",
                                "--http-port", "40100", "--store", "/var/lib/phalanx/store",
                                "--tls-cert", "/etc/phalanx-tls/tls.crt",
                                "--tls-key", "/etc/phalanx-tls/tls.key"]
    assert {(p["name"], p["containerPort"]) for p in agent["ports"]} == {
        ("control", 40000), ("http", 40100)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_phalanx_agent_accepts_the_pods_command(variant):
    """Every flag the manifest passes is one ``phalanx agent`` has, with a valid value."""
    command = container(k8s.manifest(**VARIANTS[variant]))["command"]
    assert command[:2] == ["phalanx", "agent"]
    options = cli.build_parser().parse_args(command[1:])
    assert options.command == "agent"
    assert (options.host, options.store) == ("0.0.0.0", "/var/lib/phalanx/store")
    assert options.token_file is None  # the token comes as $PHALANX_TOKEN
    assert (options.tls_cert is None) == (options.tls_key is None) == bool(
        VARIANTS[variant].get("insecure"))


def test_the_http_port_defaults_to_the_next_one():
    agent = container(k8s.manifest("a", 1, "app", port=5000, controller_selector="a=b"))
    assert agent["command"][4:8] == ["--port", "5000", "--http-port", "5001"]
    agent = container(k8s.manifest("a", 1, "app", controller_selector="a=b"))
    assert agent["command"][4:8] == ["--port", "32300", "--http-port", "32301"]


@pytest.mark.parametrize("probe", ["readinessProbe", "livenessProbe"])
def test_the_probes_get_health_on_the_http_port(probe):
    agent = container(k8s.manifest(**FULL))
    get = agent[probe]["httpGet"]
    assert get["path"] == "/health"
    named = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert named.get(get["port"], get["port"]) == 40100
    assert agent[probe]["periodSeconds"] >= 1
    assert agent[probe]["failureThreshold"] >= 2


def test_the_pods_take_the_generated_token_from_the_secret_as_an_environment_variable():
    """Not as a file: with fsGroup the kubelet makes a Secret's files group-readable,
    which the agent refuses for a token file (and without it a root-owned 0400 file is
    unreadable by the non-root agent)."""
    kinds = by_kind(k8s.manifest(**FULL))
    secret = kinds["Secret"]
    assert secret["type"] == "Opaque"
    token = base64.b64decode(secret["data"]["token"], validate=True).decode()
    assert len(token) >= 43 and set(token) <= set(string.ascii_letters + string.digits + "-_")
    agent = container([kinds["StatefulSet"]])
    (variable,) = [v for v in agent["env"] if v["name"] == config.ENV_TOKEN]
    assert variable == {"name": "PHALANX_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": secret["metadata"]["name"], "key": "token"}}}
    assert config.ENV_TOKEN in config.WITHHELD_FROM_RANKS  # no rank inherits it
    assert "--token-file" not in agent["command"]
    assert all("secret" not in v or v["secret"]["secretName"] != secret["metadata"]["name"]
               for v in pod([kinds["StatefulSet"]])["volumes"])


def test_token_secret_omits_the_secret_and_is_used_instead():
    objects = k8s.manifest(**dict(FULL, token_secret="existing"))
    assert "Secret" not in by_kind(objects)
    (variable,) = [v for v in container(objects)["env"] if v["name"] == "PHALANX_TOKEN"]
    assert variable["valueFrom"]["secretKeyRef"] == {"name": "existing", "key": "token"}


def tls_volume(objects: list[dict]) -> dict | None:
    return next((v for v in pod(objects)["volumes"] if "secret" in v), None)


@pytest.mark.parametrize(("options", "secret"), [({}, "trainer-tls"),
                                                 ({"tls_secret": "agents.tls"}, "agents.tls")])
def test_tls_is_on_by_default_with_the_secret_mounted_read_only(options, secret):
    objects = k8s.manifest(**dict(FULL, **options))
    tls = tls_volume(objects)
    assert tls is not None and tls["secret"]["secretName"] == secret
    assert tls["secret"]["items"] == [{"key": "tls.crt", "path": "tls.crt"},
                                      {"key": "tls.key", "path": "tls.key"}]
    assert tls["secret"].get("optional") is not True  # no Secret, no pod: never plain TCP
    # readable by the fsGroup the agent runs in (the kubelet adds the group's bit anyway),
    # by no one else
    assert tls["secret"]["defaultMode"] == 0o440
    assert pod(objects)["securityContext"]["fsGroup"] == container(objects)[
        "securityContext"]["runAsGroup"]
    agent = container(objects)
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == tls["name"]]
    assert mount["readOnly"] is True
    command = agent["command"]
    assert (flag(command, "--tls-cert"), flag(command, "--tls-key")) == (
        f"{mount['mountPath']}/tls.crt", f"{mount['mountPath']}/tls.key")


def test_insecure_drops_the_tls_flags_and_the_secret_volume():
    objects = k8s.manifest(**dict(FULL, insecure=True))
    command = container(objects)["command"]
    assert "--tls-cert" not in command and "--tls-key" not in command
    assert tls_volume(objects) is None
    assert all(m["name"] != "tls" for m in container(objects)["volumeMounts"])
    with pytest.raises(ValueError, match=r"--insecure .* --tls-secret"):
        k8s.manifest(**dict(FULL, insecure=True, tls_secret="x"))


def test_the_pod_and_its_container_run_as_a_fixed_non_root_user():
    objects = k8s.manifest(**FULL)
    spec = pod(objects)
    assert spec["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"}}
    assert spec["automountServiceAccountToken"] is False
    context = container(objects)["securityContext"]
    assert context == {
        "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    other = k8s.manifest(**dict(FULL, run_as_user=2000, run_as_group=3000))
    assert {key: pod(other)["securityContext"][key]
            for key in ("runAsUser", "runAsGroup", "fsGroup")} == {
        "runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 3000}
    assert (container(other)["securityContext"]["runAsUser"],
            container(other)["securityContext"]["runAsGroup"]) == (2000, 3000)


def test_what_the_agent_writes_is_on_writable_empty_dirs():
    """The root filesystem is read-only: the code store, /tmp and $HOME are emptyDirs."""
    objects = k8s.manifest(**FULL)
    agent = container(objects)
    empty = {v["name"] for v in pod(objects)["volumes"] if "emptyDir" in v}
    writable = {m["mountPath"] for m in agent["volumeMounts"]
                if m["name"] in empty and not m.get("readOnly")}
    home = next(v["value"] for v in agent["env"] if v["name"] == "HOME")
    store = flag(agent["command"], "--store")
    assert {"/tmp", home} <= writable
    assert any(store.startswith(path + "/") for path in writable), (store, writable)


# The restricted Pod Security Standard (https://kubernetes.io/docs/concepts/security/
# pod-security-standards/), as the API server's PodSecurity admission checks a pod.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(spec: dict) -> list[str]:
    found = []
    pod_context = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(key)
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {kinds}")
    for c in spec["containers"]:
        context = c.get("securityContext", {})
        if context.get("privileged"):
            found.append("privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append("allowPrivilegeEscalation")
        if not context.get("runAsNonRoot", pod_context.get("runAsNonRoot")):
            found.append("runAsNonRoot")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            found.append("runAsUser 0")
        seccomp = context.get("seccompProfile", pod_context.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append("seccompProfile")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append("capabilities.drop")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append("capabilities.add")
        if any("hostPort" in p for p in c.get("ports", [])):
            found.append("hostPort")
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_pods_meet_the_restricted_pod_security_standard(variant):
    assert restricted_violations(pod(k8s.manifest(**VARIANTS[variant]))) == []


def test_the_restricted_check_can_fail():
    spec = pod(k8s.manifest(**FULL))
    spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    spec["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    assert restricted_violations(spec) == ["volume host: {'hostPath'}",
                                           "allowPrivilegeEscalation"]


def test_the_network_policy_admits_the_controller_and_the_agents_to_the_control_port():
    kinds = by_kind(k8s.manifest(**FULL))
    policy = kinds["NetworkPolicy"]
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert (policy["metadata"]["name"], policy["metadata"]["namespace"]) == ("trainer", "ml")
    pod_labels = kinds["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"] == {"matchLabels": pod_labels}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]  # nothing for the HTTP port: only the kubelet
    assert rule["ports"] == [{"protocol": "TCP", "port": 40000}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"app": "trainer-controller"}}},  # this namespace
        {"podSelector": {"matchLabels": pod_labels}},  # tree links, kept-result copies
    ]


def test_the_network_policy_admits_controllers_and_scrapers_of_other_namespaces():
    policy = by_kind(k8s.manifest(**dict(
        FULL, controller_selector={"app": "ctl", "example.com/role": "driver"},
        controller_namespace="jobs", metrics_selector="app.kubernetes.io/name=prometheus",
        metrics_namespace="monitoring")))["NetworkPolicy"]
    control, http = policy["spec"]["ingress"]
    assert control["from"][0] == {
        "podSelector": {"matchLabels": {"app": "ctl", "example.com/role": "driver"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "jobs"}}}
    assert control["ports"] == [{"protocol": "TCP", "port": 40000}]
    assert http == {"from": [{
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "ports": [{"protocol": "TCP", "port": 40100}]}
    # the agents' own namespace needs no namespaceSelector
    same = by_kind(k8s.manifest(**dict(FULL, controller_namespace="ml")))["NetworkPolicy"]
    assert same["spec"]["ingress"][0]["from"][0] == {
        "podSelector": {"matchLabels": {"app": "trainer-controller"}}}


@pytest.mark.parametrize(("selector", "labels"), [
    ("app=trainer", {"app": "trainer"}),
    (" app = trainer , tier=gpu ", {"app": "trainer", "tier": "gpu"}),
    ("example.com/role=driver,empty=", {"example.com/role": "driver", "empty": ""}),
    ("A_b.c-D=X.y_z-1", {"A_b.c-D": "X.y_z-1"}),
])
def test_controller_selectors_become_match_labels(selector, labels):
    policy = by_kind(k8s.manifest(**dict(FULL, controller_selector=selector)))["NetworkPolicy"]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == labels


def test_no_network_policy_leaves_it_out():
    objects = k8s.manifest("a", 1, "app", network_policy=False)
    assert "NetworkPolicy" not in by_kind(objects)
    assert k8s.notes(objects) == [None, None, k8s.notes(objects)[2]]


def test_resources_come_from_cpu_memory_and_gpus():
    assert container(k8s.manifest(**FULL))["resources"] == {
        "requests": {"cpu": "16", "memory": "64Gi"},
        "limits": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": 8},
    }
    assert container(k8s.manifest("a", 1, "app", gpus=2, network_policy=False))[
        "resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert "resources" not in container(k8s.manifest("a", 1, "app", network_policy=False))


def test_two_runs_generate_different_tokens(capsys, yaml):
    tokens = []
    for _ in range(2):
        assert phalanx_k8s("manifest", *REQUIRED) == 0
        secret = next(yaml.safe_load_all(capsys.readouterr().out))
        tokens.append(secret["data"]["token"])
    assert tokens[0] != tokens[1]
    options = dict(network_policy=False)
    assert (k8s.manifest("a", 1, "app", **options)[0]["data"]
            != k8s.manifest("a", 1, "app", **options)[0]["data"])


def test_hosts_name_every_pod_of_the_stateful_set():
    assert k8s.hosts("trainer", 3, "ml", 40000) == [
        "trainer-0.trainer.ml.svc.cluster.local:40000",
        "trainer-1.trainer.ml.svc.cluster.local:40000",
        "trainer-2.trainer.ml.svc.cluster.local:40000",
    ]
    assert k8s.hosts("a", 1) == ["a-0.a.default.svc.cluster.local:32300"]
    # pod NAME-i of StatefulSet NAME behind Service serviceName in the namespace
    stateful_set = by_kind(k8s.manifest(**FULL))["StatefulSet"]
    meta, spec = stateful_set["metadata"], stateful_set["spec"]
    expected = [f"{meta['name']}-{i}.{spec['serviceName']}.{meta['namespace']}"
                f".svc.cluster.local:{FULL['port']}" for i in range(spec["replicas"])]
    assert k8s.hosts(FULL["name"], FULL["replicas"], FULL["namespace"], FULL["port"]) == expected
    with pytest.raises(ValueError, match="--replicas"):
        k8s.hosts("a", 0)


# -- the command line ----------------------------------------------------------------------


def test_the_command_prints_yaml_that_reads_back_and_validates(capsys, yaml,
                                                                kubernetes_validate):
    status = phalanx_k8s("manifest", "--name", "trainer", "--replicas", "3", "--image",
                         "app:1", "--namespace", "ml", "--cpu", "2", "--memory", "8Gi",
                         "--gpus", "1", "--controller-selector", "app=ctl,tier=driver",
                         "--controller-namespace", "jobs", "--metrics-selector", "app=prom",
                         "--run-as-user", "4242", "--run-as-group", "4343")
    assert status == 0
    out = capsys.readouterr()
    assert out.err == ""
    objects = list(yaml.safe_load_all(out.out))
    assert [obj["kind"] for obj in objects] == ["Secret", "Service", "NetworkPolicy",
                                                "StatefulSet"]
    assert by_kind(objects)["StatefulSet"]["spec"]["replicas"] == 3
    assert pod(objects)["securityContext"]["runAsUser"] == 4242
    assert pod(objects)["securityContext"]["fsGroup"] == 4343
    control, http = by_kind(objects)["NetworkPolicy"]["spec"]["ingress"]
    assert control["from"][0]["podSelector"]["matchLabels"] == {"app": "ctl", "tier": "driver"}
    assert http["from"][0] == {"podSelector": {"matchLabels": {"app": "prom"}}}
    assert tls_volume(objects)["secret"]["secretName"] == "trainer-tls"
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_printed_manifest_says_what_the_policy_and_tls_need_in_comments(capsys, yaml):
    assert phalanx_k8s("manifest", *REQUIRED) == 0
    text = capsys.readouterr().out
    documents = text.split("---\n")
    policy = next(d for d in documents if "kind: NetworkPolicy" in d)
    assert policy.startswith("# Only the controller's pods (app=trainer-controller)")
    assert "kubelet" in policy and "not subject to NetworkPolicy" in policy.replace("\n# ", " ")
    stateful_set = next(d for d in documents if "kind: StatefulSet" in d)
    assert stateful_set.startswith("# TLS: the pods mount the kubernetes.io/tls Secret "
                                   "trainer-tls")
    assert "WARNING" not in text


def test_insecure_warns_on_stderr_and_in_the_manifest(capsys, yaml, kubernetes_validate):
    assert phalanx_k8s("manifest", *REQUIRED, "--insecure") == 0
    out = capsys.readouterr()
    assert "WARNING: --insecure" in out.err and "NOT encrypted" in out.err
    assert out.out.startswith("# WARNING: generated with --insecure: the agents serve plain "
                              "TCP, without TLS.\n")
    objects = list(yaml.safe_load_all(out.out))
    assert "--tls-cert" not in container(objects)["command"]
    assert tls_volume(objects) is None
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # the warning heads the first document whatever it is
    assert phalanx_k8s("manifest", *REQUIRED, "--insecure", "--token-secret", "mine") == 0
    text = capsys.readouterr().out
    assert text.startswith("# WARNING") and text.index("kind: Service") < text.index("---")


def test_no_network_policy_prints_none(capsys, yaml):
    assert phalanx_k8s("manifest", "--name", "a", "--replicas", "1", "--image", "app",
                       "--no-network-policy") == 0
    out = capsys.readouterr()
    assert out.err == ""
    assert [o["kind"] for o in yaml.safe_load_all(out.out)] == ["Secret", "Service",
                                                                "StatefulSet"]


BAD = [
    (["--name", "Trainer"], "--name"),
    (["--name", "1trainer"], "--name"),  # the Service's name must start with a letter
    (["--name", "trainer-"], "--name"),
    (["--name", "a" * 53], "--name"),
    (["--name", "tr_ainer"], "--name"),
    (["--namespace", "ML"], "--namespace"),
    (["--namespace", "a.b"], "--namespace"),
    (["--replicas", "0"], "--replicas"),
    (["--replicas", "-1"], "--replicas"),
    (["--replicas", "two"], "--replicas"),
    (["--image", ""], "--image"),
    (["--image", "app 1"], "--image"),
    (["--port", "0"], "--port"),
    (["--port", "65536"], "--port"),
    (["--port", "http"], "--port"),
    (["--port", "65535"], "--http-port"),  # its default, --port + 1, is no port
    (["--http-port", "70000"], "--http-port"),
    (["--port", "8000", "--http-port", "8000"], "--http-port"),
    (["--token-secret", "My_Secret"], "--token-secret"),
    (["--tls-secret", "-tls"], "--tls-secret"),
    (["--tls-secret", "x", "--insecure"], "--insecure"),
    (["--controller-selector", ""], "--controller-selector"),
    (["--controller-selector", "app"], "--controller-selector"),
    (["--controller-selector", "app!=x"], "--controller-selector"),
    (["--controller-selector", "app==x"], "--controller-selector"),
    (["--controller-selector", "app in (x)"], "--controller-selector"),
    (["--controller-selector", "a=b,"], "--controller-selector"),
    (["--controller-selector", "=x"], "--controller-selector"),
    (["--controller-selector", "-app=x"], "--controller-selector"),
    (["--controller-selector", "a/b/c=x"], "--controller-selector"),
    (["--controller-selector", "Bad_Prefix/app=x"], "--controller-selector"),
    (["--controller-selector", "app=" + "x" * 64], "--controller-selector"),
    (["--controller-selector", "app=x y"], "--controller-selector"),
    (["--controller-selector", "a=1,a=2"], "--controller-selector"),
    (["--controller-namespace", "Jobs"], "--controller-namespace"),
    (["--metrics-selector", "prometheus"], "--metrics-selector"),
    (["--metrics-namespace", "monitoring"], "--metrics-namespace"),  # with no selector
    (["--metrics-selector", "a=b", "--metrics-namespace", "mon.itoring"],
     "--metrics-namespace"),
    (["--no-network-policy", "--controller-namespace", "jobs"], "--controller-namespace"),
    (["--run-as-user", "0"], "--run-as-user"),
    (["--run-as-user", "-5"], "--run-as-user"),
    (["--run-as-user", str(2**31)], "--run-as-user"),
    (["--run-as-user", "root"], "--run-as-user"),
    (["--run-as-group", "0"], "--run-as-group"),
    (["--cpu", "lots"], "--cpu"),
    (["--cpu", "0"], "--cpu"),
    (["--memory", "-1Gi"], "--memory"),
    (["--gpus", "-1"], "--gpus"),
]


@pytest.mark.parametrize(("args", "option"), BAD, ids=[" ".join(a)[:30] for a, _ in BAD])
def test_bad_options_exit_2_naming_the_option_and_print_nothing(args, option, capsys):
    good = {"--name": "trainer", "--replicas": "2", "--image": "app",
            "--controller-selector": CONTROLLER}
    for name, value in good.items():
        if name not in args and not (name == "--controller-selector"
                                     and "--no-network-policy" in args):
            args = [name, value, *args]
    assert phalanx_k8s("manifest", *args) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert option in out.err


@pytest.mark.parametrize("missing", ["--name", "--replicas", "--image"])
def test_required_options_exit_2_naming_them(missing, capsys):
    args = {"--name": "trainer", "--replicas": "2", "--image": "app"}
    del args[missing]
    assert phalanx_k8s("manifest", *[part for item in args.items() for part in item]) == 2
    assert missing in capsys.readouterr().err


def test_the_controller_selector_is_required_with_a_network_policy(capsys):
    assert phalanx_k8s("manifest", "--name", "a", "--replicas", "1", "--image", "app") == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "--controller-selector is required" in out.err and "--no-network-policy" in out.err
    assert phalanx_k8s("manifest", "--name", "a", "--replicas", "1", "--image", "app",
                       "--no-network-policy", "--controller-selector", "a=b") == 2
    assert "--no-network-policy" in capsys.readouterr().err


def test_manifest_raises_value_error_naming_the_option():
    with pytest.raises(ValueError, match="--replicas must be at least 1, got 0"):
        k8s.manifest("a", 0, "app", controller_selector="a=b")
    with pytest.raises(ValueError, match=re.escape("--name must be a DNS label")):
        k8s.manifest("A", 1, "app", controller_selector="a=b")
    with pytest.raises(ValueError, match="--memory"):
        k8s.manifest("a", 1, "app", memory="-1Gi", controller_selector="a=b")
    with pytest.raises(TypeError, match="--port"):
        k8s.manifest("a", 1, "app", port="80", controller_selector="a=b")
    with pytest.raises(ValueError, match="--controller-selector is required"):
        k8s.manifest("a", 1, "app")
    with pytest.raises(ValueError, match=r"--controller-selector .* at least one label"):
        k8s.manifest("a", 1, "app", controller_selector={})
    with pytest.raises(TypeError, match="--controller-selector"):
        k8s.manifest("a", 1, "app", controller_selector=["app=x"])
    with pytest.raises(TypeError, match="--controller-selector"):
        k8s.manifest("a", 1, "app", controller_selector={"app": 1})
    with pytest.raises(TypeError, match="--insecure"):
        k8s.manifest("a", 1, "app", controller_selector="a=b", insecure="yes")
    with pytest.raises(TypeError, match="--no-network-policy"):
        k8s.manifest("a", 1, "app", network_policy=None)
    with pytest.raises(TypeError, match="--run-as-user"):
        k8s.manifest("a", 1, "app", controller_selector="a=b", run_as_user=True)
    with pytest.raises(ValueError, match="--run-as-group must not be 0"):
        k8s.manifest("a", 1, "app", controller_selector="a=b", run_as_group=0)


# -- the YAML writer -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_yaml_reads_back_as_the_objects(variant, yaml):
    objects = k8s.manifest(**VARIANTS[variant])
    for comments in (None, k8s.notes(objects)):
        text = k8s_cli.to_yaml(objects, comments)
        assert list(yaml.safe_load_all(text)) == objects
        assert text.count("\n---\n") == len(objects) - 1


def test_comments_read_back_as_nothing(yaml):
    objects = [{"a": 1}, ["b"], "c"]
    comments = ["one line", None, "two\n  lines: - [not yaml] #\n\nand a blank one"]
    text = k8s_cli.to_yaml(objects, comments)
    assert text.startswith("# one line\na: 1\n---\n- b\n---\n# two\n#   lines: - [")
    assert "\n#\n# and a blank one\n" in text
    assert list(yaml.safe_load_all(text)) == objects
    with pytest.raises(ValueError, match=r"one comment .* each of the 3 objects, got 2"):
        k8s_cli.to_yaml(objects, ["a", "b"])
    with pytest.raises(ValueError, match="printable"):
        k8s_cli.to_yaml([1], ["carriage\rreturn"])
    with pytest.raises(TypeError, match="comments that are strings"):
        k8s_cli.to_yaml([1], [b"bytes"])


TRICKY = ["", "true", "False", "yes", "NO", "on", "Off", "y", "N", "null", "Null", "~", "123",
          "-5", "1.5", "1e3", ".inf", "-.inf", ".NaN", "0x1f", "0o17", "012", "1_000", "1:20",
          "2024-01-01", "2001-12-14t21:59:43.10-05:00", "a: b", "a #b", "#c", "- x", "-",
          "---", "...", "? q", "[1]", "{a: 1}", "*ref", "&anchor", "!tag", "%dir", "@at",
          "`tick", "|", ">", "'", '"', "\\", "<<", "=", " lead", "trail ", "tab\there",
          "line\nbreak", "cr\rlf", "\x00\x07\x7f\x85\u2028\ufeff", "ünïcødé", "😀", "a,b",
          "3Gi", "500m", "0.0.0.0", "/etc/phalanx"]


def test_strings_that_look_like_something_else_stay_strings(yaml):
    data = {text: text for text in TRICKY}
    data["list"] = list(TRICKY)
    assert yaml.safe_load(k8s_cli.to_yaml([data])) == data


plain_data = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=20), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(plain_data, min_size=1, max_size=3))
def test_any_plain_data_reads_back_as_written(documents):
    assert list(pyyaml.safe_load_all(k8s_cli.to_yaml(documents))) == documents


def test_long_keys_and_values_read_back_on_their_lines(yaml):
    long = {"k" * 2000: "v" * 5000, '"' * 600: [1], "x": "word " * 100}
    text = k8s_cli.to_yaml([long])
    assert yaml.safe_load(text) == long
    assert f"{'v' * 5000}\n" in text and ("word " * 99) in text  # none folded


@pytest.mark.parametrize("text", ["y", "N", "1e3", "-2E5", ".5e1", "0o17", "0O17", "0b101",
                                  "1_000", "0x_1f", "500m", "64Gi", "2024-01-01"])
def test_strings_other_readers_take_for_numbers_or_booleans_are_quoted(text, yaml):
    """PyYAML (YAML 1.1) reads these plain as strings; kubectl's reader (go-yaml: y and n
    are booleans, numbers as Go parses them) or a YAML 1.2 reader (1e3, 0o17) would not."""
    written = k8s_cli.to_yaml([{"v": text}])
    assert written in (f"v: '{text}'\n", f'v: "{text}"\n')
    assert yaml.safe_load(written) == {"v": text}


def test_the_manifest_is_block_style_in_the_objects_key_order():
    objects = k8s.manifest(**FULL)
    documents = k8s_cli.to_yaml(objects).split("---\n")
    assert [d.split("\n", 2)[:2] for d in documents] == [
        [f"apiVersion: {o['apiVersion']}", f"kind: {o['kind']}"] for o in objects]
    stateful_set = documents[-1]
    assert "\n      containers:\n        - name: agent\n          image: " in stateful_set
    assert "emptyDir: {}\n" in stateful_set and "{" not in stateful_set.replace("{}", "")


def test_the_command_line_imports_pyyaml_only_to_write_a_manifest():
    """``phalanx run`` (and ``import phalanx``) start without PyYAML; a manifest loads it."""
    code = ("import sys; import phalanx, phalanx.cli.main as m; assert 'yaml' not in sys.modules; "
            "m.main(['k8s', 'manifest', '--name', 'a', '--replicas', '1', '--image', 'app', "
            "'--no-network-policy']); assert 'yaml' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "kind: StatefulSet" in done.stdout


@pytest.mark.parametrize("value", [1j, [object()], {"a": {"b": object()}}])
def test_to_yaml_refuses_what_it_cannot_write_back(value):
    with pytest.raises(TypeError, match="to_yaml writes plain data only"):
        k8s_cli.to_yaml([value])
