"""``phalanx k8s manifest``: the objects it prints, checked offline.

The objects are validated against Kubernetes' own OpenAPI schemas (bundled with
``kubernetes-validate``, strict: an unknown field is an error), and the YAML is read back with
PyYAML: both are test dependencies only, the module itself uses the standard library. The
command line is driven through a fresh ``argparse`` parser built by ``k8s.add_parser``, the
way ``phalanx``'s own parser includes it.
"""

from __future__ import annotations

import argparse
import base64
import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.backends.cluster import k8s

K8S_VERSION = "1.30"  # the schemas the objects are checked against
YAML_REASON = "reading the manifest back needs PyYAML (pip install 'phalanx[test]')"

FULL = dict(name="trainer", replicas=4, image="registry.example.com/app:1.0", namespace="ml",
            port=40000, http_port=40100, cpu="16", memory="64Gi", gpus=8)
VARIANTS = {
    "defaults": dict(name="agents", replicas=1, image="app"),
    "all options": FULL,
    "token secret": dict(FULL, token_secret="team.phalanx-token"),
    "tls secret": dict(FULL, tls_secret="trainer-tls"),
    "cpu only": dict(name="a1", replicas=2, image="app", cpu="500m"),
    "gpus only": dict(name="a1", replicas=2, image="app", gpus=1),
}


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip(
        "kubernetes_validate",
        reason="validating against Kubernetes' schemas needs kubernetes-validate "
               "(pip install 'phalanx[test]')")


@pytest.fixture(scope="module")
def yaml():
    return pytest.importorskip("yaml", reason=YAML_REASON)


def by_kind(objects: list[dict]) -> dict[str, dict]:
    kinds = [obj["kind"] for obj in objects]
    assert len(set(kinds)) == len(kinds), kinds
    return {obj["kind"]: obj for obj in objects}


def container(objects: list[dict]) -> dict:
    (agent,) = by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return agent


def phalanx_k8s(*args: str) -> int:
    """``phalanx k8s ARGS...`` through a fresh top-level parser; its exit status."""
    parser = argparse.ArgumentParser(prog="phalanx")
    k8s.add_parser(parser.add_subparsers(dest="command"))
    try:
        options = parser.parse_args(["k8s", *args])
    except SystemExit as exc:  # argparse's own refusal (not an integer, a missing option)
        return exc.code
    return options.func(options)


# -- the objects ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_objects_validate_against_the_kubernetes_schemas(variant, kubernetes_validate):
    objects = k8s.manifest(**VARIANTS[variant])
    assert [obj["kind"] for obj in objects] == (
        ["Service", "StatefulSet"] if "token_secret" in VARIANTS[variant]
        else ["Secret", "Service", "StatefulSet"])
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


def test_the_container_runs_the_agent_on_both_ports():
    agent = container(k8s.manifest(**FULL))
    assert agent["image"] == "registry.example.com/app:1.0"
    assert agent["command"] == ["phalanx", "agent", "--host", "0.0.0.0", "--port", "40000",
                                "--http-port", "40100", "--token-file", "/etc/phalanx/token"]
    assert {(p["name"], p["containerPort"]) for p in agent["ports"]} == {
        ("control", 40000), ("http", 40100)}


def test_the_http_port_defaults_to_the_next_one():
    agent = container(k8s.manifest("a", 1, "app", port=5000))
    assert agent["command"][4:8] == ["--port", "5000", "--http-port", "5001"]
    agent = container(k8s.manifest("a", 1, "app"))
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


def test_the_pods_mount_the_generated_secret_read_only():
    kinds = by_kind(k8s.manifest(**FULL))
    secret = kinds["Secret"]
    assert secret["type"] == "Opaque"
    token = base64.b64decode(secret["data"]["token"], validate=True).decode()
    assert len(token) >= 43 and set(token) <= set(string.ascii_letters + string.digits + "-_")
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert {"key": "token", "path": "token"} in volume["secret"]["items"]
    assert volume["secret"]["defaultMode"] == 0o400  # the agent refuses a readable token
    (mount,) = container([kinds["StatefulSet"]])["volumeMounts"]
    assert (mount["name"], mount["mountPath"], mount["readOnly"]) == (
        volume["name"], "/etc/phalanx", True)


def test_token_secret_omits_the_secret_and_is_mounted_instead():
    objects = k8s.manifest(**dict(FULL, token_secret="existing"))
    assert "Secret" not in by_kind(objects)
    (volume,) = by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]["volumes"]
    assert volume["secret"]["secretName"] == "existing"


def test_tls_secret_mounts_the_certificate_and_key_the_agent_serves_with():
    objects = k8s.manifest(**dict(FULL, tls_secret="trainer-tls"))
    pod = by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]
    token, tls = pod["volumes"]
    assert token["secret"]["items"] == [{"key": "token", "path": "token"}]
    assert tls["secret"]["secretName"] == "trainer-tls"
    assert [item["key"] for item in tls["secret"]["items"]] == ["tls.crt", "tls.key"]
    assert tls["secret"]["defaultMode"] == 0o400
    agent = container(objects)
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "tls")
    command = agent["command"]
    cert, key = (command[command.index(flag) + 1] for flag in ("--tls-cert", "--tls-key"))
    assert (cert, key) == (f"{mount['mountPath']}/tls.crt", f"{mount['mountPath']}/tls.key")
    assert mount["readOnly"] and mount["mountPath"] != "/etc/phalanx"
    assert "--tls-cert" not in container(k8s.manifest(**FULL))["command"]


def test_resources_come_from_cpu_memory_and_gpus():
    assert container(k8s.manifest(**FULL))["resources"] == {
        "requests": {"cpu": "16", "memory": "64Gi"},
        "limits": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": 8},
    }
    assert container(k8s.manifest("a", 1, "app", gpus=2))["resources"] == {
        "limits": {"nvidia.com/gpu": 2}}
    assert "resources" not in container(k8s.manifest("a", 1, "app"))


def test_two_runs_generate_different_tokens(capsys, yaml):
    tokens = []
    for _ in range(2):
        assert phalanx_k8s("manifest", "--name", "a", "--replicas", "1", "--image", "app") == 0
        secret = next(yaml.safe_load_all(capsys.readouterr().out))
        tokens.append(secret["data"]["token"])
    assert tokens[0] != tokens[1]
    assert k8s.manifest("a", 1, "app")[0]["data"] != k8s.manifest("a", 1, "app")[0]["data"]


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
                         "--gpus", "1")
    assert status == 0
    out = capsys.readouterr()
    assert out.err == ""
    objects = list(yaml.safe_load_all(out.out))
    assert [obj["kind"] for obj in objects] == ["Secret", "Service", "StatefulSet"]
    assert by_kind(objects)["StatefulSet"]["spec"]["replicas"] == 3
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


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
    (["--cpu", "lots"], "--cpu"),
    (["--cpu", "0"], "--cpu"),
    (["--memory", "-1Gi"], "--memory"),
    (["--gpus", "-1"], "--gpus"),
]


@pytest.mark.parametrize(("args", "option"), BAD, ids=[" ".join(a)[:30] for a, _ in BAD])
def test_bad_options_exit_2_naming_the_option_and_print_nothing(args, option, capsys):
    good = {"--name": "trainer", "--replicas": "2", "--image": "app"}
    for flag, value in good.items():
        if flag not in args:
            args = [flag, value, *args]
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


def test_manifest_raises_value_error_naming_the_option():
    with pytest.raises(ValueError, match="--replicas must be at least 1, got 0"):
        k8s.manifest("a", 0, "app")
    with pytest.raises(ValueError, match=re.escape("--name must be a DNS label")):
        k8s.manifest("A", 1, "app")
    with pytest.raises(ValueError, match="--memory"):
        k8s.manifest("a", 1, "app", memory="-1Gi")
    with pytest.raises(TypeError, match="--port"):
        k8s.manifest("a", 1, "app", port="80")


# -- the YAML writer -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_yaml_reads_back_as_the_objects(variant, yaml):
    objects = k8s.manifest(**VARIANTS[variant])
    text = k8s.to_yaml(objects)
    assert list(yaml.safe_load_all(text)) == objects
    assert text.count("\n---\n") == len(objects) - 1


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
    assert yaml.safe_load(k8s.to_yaml([data])) == data


plain_data = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=20), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(plain_data, min_size=1, max_size=3))
def test_any_plain_data_reads_back_as_written(documents):
    yaml = pytest.importorskip("yaml", reason=YAML_REASON)  # hypothesis refuses fixtures
    assert list(yaml.safe_load_all(k8s.to_yaml(documents))) == documents


def test_keys_up_to_yamls_limit_are_written_and_longer_ones_refused(yaml):
    fits = {"k" * 1024: 1, '"' * 511: [1]}  # 1024 characters written, quotes and escapes too
    assert yaml.safe_load(k8s.to_yaml([fits])) == fits
    with pytest.raises(ValueError, match="keys of at most 1024"):
        k8s.to_yaml([{"k" * 1025: 1}])
    with pytest.raises(ValueError, match="keys of at most 1024"):
        k8s.to_yaml([{"x": [{'"' * 512: 1}]}])


@pytest.mark.parametrize("value", [1.5, (1, 2), {1: "a"}, {"a": {1, 2}}, b"bytes", [object()]])
def test_to_yaml_refuses_what_it_cannot_write_back(value):
    with pytest.raises(TypeError, match="to_yaml"):
        k8s.to_yaml([value])
