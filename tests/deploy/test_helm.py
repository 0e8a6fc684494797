"""The Helm chart (deploy/helm/tandem), rendered by Helm's own template engine.

helm-python-sdk binds Helm's Go SDK (v4) through ctypes, so `helm template` runs here without
a helm binary; kubernetes-validate checks every built-in object against the Kubernetes
OpenAPI schemas it ships (offline, strict: unknown fields fail).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
from helm_render import (
    CHART,
    HEAD,
    NAMESPACE,
    RELEASE,
    SCENARIOS,
    components,
    container,
    find,
    flag,
    gpu_values,
    manifests,
    render,
    router_args,
)
from packaging.version import Version

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "tandem.json"
KUBE_VERSION = "1.28"  # the oldest Kubernetes the chart targets (gRPC probes are GA since 1.27)
# The oldest schemas kubernetes-validate ships that are not older than that.
SCHEMA_VERSION = min((v for v in kubernetes_validate.utils.all_versions() if Version(v) >= Version(KUBE_VERSION)),
                     key=Version)

DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
STANDARD_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by")


def test_every_object_is_well_formed(rendered):
    seen = set()
    for doc in rendered:
        assert doc["apiVersion"] and doc["kind"], doc
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and DNS1123_SUBDOMAIN.match(name), name
        if doc["kind"] == "Service":
            assert DNS1035_LABEL.match(name), name
        assert (doc["kind"], name) not in seen, f"duplicate {doc['kind']}/{name}"
        seen.add((doc["kind"], name))
        labels = doc["metadata"]["labels"]
        assert all(labels.get(k) for k in STANDARD_LABELS), labels
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_long_release_names_stay_dns_labels():
    release = "release-" + "x" * 45  # 53 characters: the longest release name Helm accepts
    docs = render(release=release)
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert len(names) == 4 and all(len(n) <= 63 and DNS1035_LABEL.match(n) for n in names), names
    head = find(docs, "Service", "ray-head")["metadata"]["name"]
    assert f"--address={head}:6379" in container(find(docs, "Deployment", "prefill"))["args"]


def test_objects_match_the_kubernetes_schemas(rendered):
    errors = []
    for doc in rendered:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema shipped; checked in test_service_monitor
        try:
            kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
    assert not errors, "\n".join(errors)


def test_deployments_select_their_pods_and_run_probed_containers(rendered):
    for dep in (d for d in rendered if d["kind"] == "Deployment"):
        selector = dep["spec"]["selector"]["matchLabels"]
        pod = dep["spec"]["template"]
        assert selector.items() <= pod["metadata"]["labels"].items(), dep["metadata"]["name"]
        c = container(dep)
        assert c["image"].startswith("tandem:") and c["command"] and c["args"]
        assert c["readinessProbe"] and c["livenessProbe"], dep["metadata"]["name"]
        assert pod["spec"]["automountServiceAccountToken"] is False


def test_services_select_pods_and_name_their_ports(rendered):
    pods = [d["spec"]["template"] for d in rendered if d["kind"] == "Deployment"]
    for svc in (d for d in rendered if d["kind"] == "Service"):
        matching = [p for p in pods if svc["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
        assert len(matching) == 1, svc["metadata"]["name"]
        port_names = {p["name"] for c in matching[0]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names


def test_ray_cluster_layout(rendered):
    head = container(find(rendered, "Deployment", "ray-head"))
    assert head["command"] == ["ray"]
    assert {"start", "--head", "--port=6379", "--num-cpus=0", "--include-dashboard=false",
            "--block"} <= set(head["args"])
    assert head["readinessProbe"]["tcpSocket"]["port"] == "gcs"
    for role in components(rendered) - {"ray-head", "router"}:
        dep = find(rendered, "Deployment", role)
        worker = container(dep)
        assert worker["command"] == ["ray"] and worker["args"][0] == "start"
        assert f"--address={HEAD}" in worker["args"] and "--block" in worker["args"]
        resources = next(a for a in worker["args"] if a.startswith("--resources="))
        assert json.loads(resources.removeprefix("--resources=")) == {f"tandem_{role}": 1}
        assert worker["readinessProbe"]["exec"]["command"] == ["ray", "health-check", f"--address={HEAD}"]
        # Liveness follows the engine loops' heartbeat files (tandem/worker/heartbeat_file.py) too.
        env = {e["name"]: e.get("value") for e in worker["env"]}
        beats = env["TANDEM_HEARTBEAT_DIR"]
        assert {"name": "heartbeats", "mountPath": beats} in worker["volumeMounts"]
        assert {"name": "heartbeats", "emptyDir": {}} in dep["spec"]["template"]["spec"]["volumes"]
        assert worker["livenessProbe"]["exec"]["command"] == [
            "sh", "-c", f"tandem heartbeat-check {beats} --max-age 180 && ray health-check --address={HEAD}"]
        init = dep["spec"]["template"]["spec"]["initContainers"][0]
        assert HEAD in init["command"][-1]


def token_env(docs: list[dict]) -> dict:
    [env] = [e for e in container(find(docs, "Deployment", "router"))["env"] if e["name"] == "TANDEM_AUTH_TOKEN"]
    return env["valueFrom"]["secretKeyRef"]


def api_secrets(docs: list[dict]) -> list[dict]:
    """The API token's Secrets (not Ray's, not the KV sockets', not the admin key's)."""
    return [d for d in docs if d["kind"] == "Secret"
            and d["metadata"]["name"] not in (RAY_AUTH_SECRET, KV_SECRET, ADMIN_SECRET)]


RAY_AUTH_SECRET = f"{RELEASE}-tandem-ray-auth"
KV_SECRET = f"{RELEASE}-tandem-kv-secret"
ADMIN_SECRET = f"{RELEASE}-tandem-admin"


def ray_auth_envs(docs: list[dict]) -> dict[str, dict]:
    """Each container (init containers too) of each Deployment -> its Ray auth env."""
    found = {}
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}
            found[f"{dep['metadata']['name']}/{c['name']}"] = {k: v for k, v in env.items() if k.startswith("RAY_AUTH")}
    return found


def test_ray_token_auth_on_every_ray_process():
    """Every Ray node, the router (a Ray driver) and the probes' init containers present Ray's
    token, from a Secret the chart creates with a random token."""
    rendered = render()
    envs = ray_auth_envs(rendered)
    assert len(envs) == 7, envs  # the head, 2 workers and the router, and their init containers
    for name, env in envs.items():
        assert env == {"RAY_AUTH_MODE": "token",
                       "RAY_AUTH_TOKEN": {"secretKeyRef": {"name": RAY_AUTH_SECRET, "key": "token"}}}, name
    [secret] = [d for d in rendered if d["kind"] == "Secret" and d["metadata"]["name"] == RAY_AUTH_SECRET]
    token = base64.b64decode(secret["data"]["token"])
    assert len(token) == 48 and token != base64.b64decode(find_ray_secret(render())["data"]["token"])
    given = find_ray_secret(render({"ray": {"auth": {"token": "ray-s3cret"}}}))
    assert base64.b64decode(given["data"]["token"]) == b"ray-s3cret"
    mine = render({"ray": {"auth": {"existingSecret": "my-ray", "existingSecretKey": "t"}}})
    assert not [d for d in mine if d["kind"] == "Secret" and d["metadata"]["name"] != ADMIN_SECRET]
    assert {str(e) for e in ray_auth_envs(mine).values()} == {
        str({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": {"secretKeyRef": {"name": "my-ray", "key": "t"}}})}
    off = render({"ray": {"auth": {"enabled": False}}})
    assert not any(ray_auth_envs(off).values())
    assert not [d for d in off if d["kind"] == "Secret" and d["metadata"]["name"] != ADMIN_SECRET]


def kv_secret_envs(docs: list[dict]) -> dict[str, dict]:
    """Each Deployment's main container -> its TANDEM_KV_SECRET, when it has one."""
    return {dep["metadata"]["name"]: e["valueFrom"]["secretKeyRef"]
            for dep in docs if dep["kind"] == "Deployment"
            for e in container(dep).get("env", []) if e["name"] == "TANDEM_KV_SECRET"}


def test_kv_encryption_gives_every_worker_pod_the_secret():
    """Off by default; on, every Ray pod (where the workers' KV sockets are) gets TANDEM_KV_SECRET
    from a Secret the chart creates with a random secret, or from one the operator names."""
    assert not kv_secret_envs(render()) and not [d for d in render() if d["metadata"]["name"] == KV_SECRET]
    docs = render(SCENARIOS["kv-encryption"])
    envs = kv_secret_envs(docs)
    assert envs == {f"{RELEASE}-tandem-{c}": {"name": KV_SECRET, "key": "secret"}
                    for c in ("ray-head", "prefill", "decode", "router")}  # every Ray node
    [secret] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == KV_SECRET]
    assert len(base64.b64decode(secret["data"]["secret"])) == 48
    mine = render({"kvTransfer": {"encryption": {"enabled": True, "existingSecret": "kv", "existingSecretKey": "k"}}})
    assert set(map(str, kv_secret_envs(mine).values())) == {str({"name": "kv", "key": "k"})}
    assert not [d for d in mine if d["metadata"]["name"] == KV_SECRET]


def find_ray_secret(docs: list[dict]) -> dict:
    [secret] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == RAY_AUTH_SECRET]
    return secret


def test_network_policies_keep_ray_and_kv_ports_to_the_release():
    rendered = render()
    policies = {d["metadata"]["name"]: d["spec"] for d in rendered if d["kind"] == "NetworkPolicy"}
    release = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": RELEASE}
    ray = policies[f"{RELEASE}-tandem-ray"]
    assert ray["podSelector"]["matchLabels"] == release
    assert ray["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["router"]}]
    assert ray["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in rendered if d["kind"] == "Deployment"}
    guarded = {name for name, labels in pods.items() if release.items() <= labels.items()
               and labels["app.kubernetes.io/component"] != "router"}
    assert len(guarded) == 3  # the head and both pools' workers
    router = policies[f"{RELEASE}-tandem-router"]
    assert router["ingress"][1] == {"ports": [{"port": p, "protocol": "TCP"} for p in ("grpc", "http", "metrics")]}
    clients = [{"namespaceSelector": {"matchLabels": {"name": "apps"}}}]
    limited = render({"networkPolicy": {"routerClients": clients}})
    [router] = [d["spec"] for d in limited if d["kind"] == "NetworkPolicy" and "router" in d["metadata"]["name"]]
    assert router["ingress"][1]["from"] == clients
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_auth_from_a_created_secret():
    docs = render(SCENARIOS["auth-created"])
    ref = token_env(docs)
    [secret] = api_secrets(docs)
    assert secret["metadata"]["name"] == ref["name"]
    assert base64.b64decode(secret["data"][ref["key"]]) == b"s3cret"
    assert "TANDEM_AUTH_TOKEN" in manifests(SCENARIOS["auth-created"])["tandem/templates/NOTES.txt"]


def test_auth_from_an_existing_secret():
    docs = render(SCENARIOS["auth-existing"])
    assert token_env(docs) == {"name": "my-token", "key": "api-key"}
    assert not api_secrets(docs)


def test_service_monitor():
    docs = render(SCENARIOS["service-monitor"])
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"] == "kps"
    svc = find(docs, "Service", "router")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # the workers' instance labels survive the scrape


def test_grafana_dashboards_configmap():
    docs = render()
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"], "no dashboards found in the chart's dashboards/ folder"
    for key, text in cm["data"].items():
        assert key.endswith(".json") and isinstance(json.loads(text), dict)
    # dashboards/tandem.json is a symlink to the Grafana folder's file, and Helm follows it.
    assert json.loads(cm["data"]["tandem.json"]) == json.loads(DASHBOARD.read_text())
    assert not [d for d in render({"grafana": {"dashboards": {"enabled": False}}}) if d["kind"] == "ConfigMap"]


def test_model_volume_is_mounted_into_workers_only():
    docs = render(SCENARIOS["model-volume"])
    assert flag(router_args(docs), "--model") == "/models/qwen2"
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", role)
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container(dep)["volumeMounts"]
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "models"
    assert "model" not in json.dumps(find(docs, "Deployment", "router")["spec"]["template"]["spec"]["volumes"])


@pytest.mark.parametrize("values, message", [
    ({"mode": "split"}, "mode must be"),
    ({"router": {"replicas": 2}}, "router.replicas must be 1"),
    ({"policy": "random"}, "policy must be"),
    ({"pools": {"decode": {"tp": 3}}}, "decode tp must be >= 1 and fit its pod"),  # 2 CPUs
])
def test_bad_values_fail_to_render(values, message):
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)


def test_helm_lint_is_clean():
    for values in ({}, gpu_values(), SCENARIOS["colocated"]):
        report = helm_python.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}.0")
        assert not report["errors"], report
        assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


def test_a_hub_model_is_downloaded_by_each_worker_pod_first():
    """model: org/name: each worker pod's init container runs `tandem download` (with HF_TOKEN
    from hf.tokenSecret) into a cache the worker then reads; extraArgs and env reach their
    containers; a path model has no download step."""
    docs = render(SCENARIOS["hub-model"])
    hf_token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", role)
        spec = dep["spec"]["template"]["spec"]
        init = {c["name"]: c for c in spec["initContainers"]}["download-model"]
        assert init["command"] == ["tandem", "download", "Qwen/Qwen2.5-0.5B-Instruct", "--revision", "v1"]
        assert {"name": "HF_HOME", "value": "/var/cache/huggingface"} in init["env"] and hf_token in init["env"]
        worker = container(dep)
        assert {"name": "HF_HOME", "value": "/var/cache/huggingface"} in worker["env"] and hf_token in worker["env"]
        for c in (init, worker):
            assert {"name": "hf-cache", "mountPath": "/var/cache/huggingface"} in c["volumeMounts"]
        assert {"name": "hf-cache", "emptyDir": {}} in spec["volumes"]
    assert {"name": "B", "value": "2"} in container(find(docs, "Deployment", "decode"))["env"]
    assert container(find(docs, "Deployment", "prefill"))["args"][-1] == "--object-store-memory=100000000"
    args = router_args(docs)
    assert flag(args, "--model") == "Qwen/Qwen2.5-0.5B-Instruct" and flag(args, "--revision") == "v1"
    assert args[-2:] == ["--served-model-name", "qwen"]
    assert {"name": "A", "value": "1"} in container(find(docs, "Deployment", "router"))["env"]
    local = render(SCENARIOS["model-volume"])
    assert not any(c["name"] == "download-model" for c in
                   find(local, "Deployment", "decode")["spec"]["template"]["spec"]["initContainers"])
