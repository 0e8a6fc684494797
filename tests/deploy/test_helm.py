"""The Helm chart (deploy/helm/tandem), rendered by Helm's own template engine.

helm-python-sdk binds Helm's Go SDK (v4) through ctypes, so `helm template` runs here without
a helm binary; kubernetes-validate checks every built-in object against the Kubernetes
OpenAPI schemas it ships (offline, strict: unknown fields fail).
"""

from __future__ import annotations

import argparse
import base64
import json
import re
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
from packaging.version import Version

from tandem.model.source import DEFAULT_MODEL_NAME, resolve_model_source
from tandem.router import serve_command
from tandem.router.policy import POLICIES

from helm_render import (
    CHART, HEAD, NAMESPACE, components, container, find, flag, gpu_values, manifests, merged, render,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "tandem.json"
KUBE_VERSION = "1.28"  # the oldest Kubernetes the chart targets (gRPC probes are GA since 1.27)
# The oldest schemas kubernetes-validate ships that are not older than that.
SCHEMA_VERSION = min((v for v in kubernetes_validate.utils.all_versions() if Version(v) >= Version(KUBE_VERSION)),
                     key=Version)

DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
STANDARD_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by")
GPU = "nvidia.com/gpu"


SCENARIOS = {
    "default": {},
    "gpu": gpu_values(),
    "colocated": {"mode": "colocated", "colocated": {"replicas": 3}},
    "auth-created": {"auth": {"token": "s3cret"}},
    "auth-existing": {"auth": {"existingSecret": "my-token", "existingSecretKey": "api-key"}},
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}}},
    "model-volume": {"model": "/models/qwen2", "modelVolume": {"existingClaim": "models"}},
}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def rendered(request) -> list[dict]:
    return render(SCENARIOS[request.param])


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
    assert {"start", "--head", "--port=6379", "--num-cpus=0", "--include-dashboard=false", "--block"} <= set(head["args"])
    assert head["readinessProbe"]["tcpSocket"]["port"] == "gcs"
    for role in components(rendered) - {"ray-head", "router"}:
        dep = find(rendered, "Deployment", role)
        worker = container(dep)
        assert worker["command"] == ["ray"] and worker["args"][0] == "start"
        assert f"--address={HEAD}" in worker["args"] and "--block" in worker["args"]
        resources = next(a for a in worker["args"] if a.startswith("--resources="))
        assert json.loads(resources.removeprefix("--resources=")) == {f"tandem_{role}": 1}
        assert worker["readinessProbe"]["exec"]["command"] == ["ray", "health-check", f"--address={HEAD}"]
        init = dep["spec"]["template"]["spec"]["initContainers"][0]
        assert HEAD in init["command"][-1]


def router_args(docs: list[dict]) -> list[str]:
    router = container(find(docs, "Deployment", "router"))
    assert router["command"][:2] == ["sh", "-c"] and f"ray start --address={HEAD}" in router["command"][2]
    assert 'exec tandem "$@"' in router["command"][2]
    return router["args"]


def test_router_defaults():
    docs = render()
    assert components(docs) == {"ray-head", "prefill", "decode", "router"}
    args = router_args(docs)
    assert args[0] == "serve" and "--pool-resources" in args
    assert (flag(args, "--prefill"), flag(args, "--decode")) == ("1", "1")
    assert (flag(args, "--prefill-tp"), flag(args, "--decode-tp")) == ("1", "1")
    assert flag(args, "--address") == HEAD and flag(args, "--host") == "0.0.0.0"
    assert (flag(args, "--port"), flag(args, "--metrics-port"), flag(args, "--http-port")) == ("50051", "9464", "8000")
    assert flag(args, "--kv-transfer-host") == "node-ip" and flag(args, "--policy") == "least_loaded"
    assert flag(args, "--dtype") == "float32" and flag(args, "--block-size") == "16"
    assert flag(args, "--num-threads") == "2"  # the pools' CPU count
    assert "--model" not in args and "--max-model-len" not in args and "--colocated" not in args
    router = find(docs, "Deployment", "router")
    c = container(router)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50051, "service": ""}
    assert router["spec"]["strategy"]["type"] == "Recreate"
    assert "TANDEM_AUTH_TOKEN" not in {e["name"] for e in c["env"]}
    annotations = router["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9464", "prometheus.io/path": "/metrics"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9464, "http": 8000}
    svc = find(docs, "Service", "router")
    assert svc["spec"]["type"] == "ClusterIP"
    assert {p["name"]: (p["port"], p["targetPort"], p["appProtocol"]) for p in svc["spec"]["ports"]} == {
        "grpc": (50051, "grpc", "grpc"), "metrics": (9464, "metrics", "http"), "http": (8000, "http", "http")}
    assert not [d for d in docs if d["kind"] in ("Secret", "ServiceMonitor")]


def test_router_args_parse_as_tandem_serve(rendered):
    """Every flag the chart passes exists in `tandem serve` and has a valid value."""
    args = router_args(rendered)
    assert args[0] == "serve"
    parser = argparse.ArgumentParser(exit_on_error=False)
    serve_command.add_args(parser)
    parsed, unknown = parser.parse_known_args(args[1:])
    assert not unknown
    assert parsed.pool_resources and parsed.kv_transfer_host == "node-ip" and parsed.address == HEAD
    assert (parsed.host, parsed.port, parsed.metrics_port, parsed.http_port) == ("0.0.0.0", 50051, 9464, 8000)


def test_router_ports_follow_their_values():
    docs = render({"router": {"grpcPort": 50052, "metricsPort": 9100, "httpPort": 8080}})
    args = router_args(docs)
    assert (flag(args, "--port"), flag(args, "--metrics-port"), flag(args, "--http-port")) == ("50052", "9100", "8080")
    router = find(docs, "Deployment", "router")
    c = container(router)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50052, "metrics": 9100, "http": 8080}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50052, "service": ""}  # the probes stay on gRPC
    assert router["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    svc = find(docs, "Service", "router")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "grpc": (50052, "grpc"), "metrics": (9100, "metrics"), "http": (8080, "http")}
    notes = manifests({"router": {"grpcPort": 50052, "metricsPort": 9100, "httpPort": 8080}})["tandem/templates/NOTES.txt"]
    assert "port-forward service/demo-tandem-router 8080:8080" in notes
    assert "curl -s 127.0.0.1:8080/v1/chat/completions " in notes and ":8000" not in notes


def notes_curl(values: dict) -> tuple[str, dict]:
    """The install notes' curl line for the OpenAI API, and the JSON body it sends."""
    [line] = [l.strip() for l in manifests(values)["tandem/templates/NOTES.txt"].splitlines()
              if l.strip().startswith("curl ")]
    return line, json.loads(line.rsplit(" -d ", 1)[1].strip("'"))


def test_notes_show_the_openai_api(tmp_path):
    notes = manifests()["tandem/templates/NOTES.txt"]
    assert "port-forward service/demo-tandem-router 8000:8000" in notes
    line, body = notes_curl({})
    assert line.startswith("curl -s 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d ")
    assert "Authorization" not in line
    # The served model's name: the tokenizer spec's model_name, as tandem names the model it loads.
    assert body == {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20}
    (tmp_path / "Qwen2-0.5B-Instruct").mkdir()
    (tmp_path / "tiny-llama.Q4_0.gguf").write_bytes(b"")
    for model in (tmp_path / "Qwen2-0.5B-Instruct", f"{tmp_path}/Qwen2-0.5B-Instruct/", tmp_path / "tiny-llama.Q4_0.gguf"):
        assert notes_curl({"model": str(model)})[1]["model"] == resolve_model_source(str(model)).name
    for auth in (SCENARIOS["auth-created"], SCENARIOS["auth-existing"]):
        assert ' -H "Authorization: Bearer $TANDEM_AUTH_TOKEN" ' in notes_curl(auth)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_router_policy_renders(policy):
    assert flag(router_args(render({"policy": policy})), "--policy") == policy


def test_pool_sizes_and_engine_args_reach_the_router():
    docs = render({"pools": {"prefill": {"replicas": 2}, "decode": {"replicas": 3}}, "policy": "prefix_aware",
                   "engine": {"maxNumBatchedTokens": 1048576, "kvCacheMemoryGib": 0.25, "maxModelLen": 32768}})
    args = router_args(docs)
    assert (flag(args, "--prefill"), flag(args, "--decode")) == ("2", "3")
    assert find(docs, "Deployment", "prefill")["spec"]["replicas"] == 2
    assert find(docs, "Deployment", "decode")["spec"]["replicas"] == 3
    assert flag(args, "--policy") == "prefix_aware"
    # Helm reads numbers as floats: large ones must not turn into 1.048576e+06.
    assert flag(args, "--max-num-batched-tokens") == "1048576"
    assert flag(args, "--kv-cache-memory-gib") == "0.25" and flag(args, "--max-model-len") == "32768"


@pytest.mark.parametrize("cpu, ray_cpus", [("1500m", "1"), ("250m", "1"), ("2.5", "2"), (3, "3")])
def test_ray_is_told_whole_cpus(cpu, ray_cpus):
    docs = render({"pools": {"prefill": {"resources": {"limits": {"cpu": cpu}}}}})
    assert f"--num-cpus={ray_cpus}" in container(find(docs, "Deployment", "prefill"))["args"]
    assert flag(router_args(docs), "--num-threads") == str(min(int(ray_cpus), 2))  # the decode pool has 2


def test_tensor_parallel_ranks_reach_the_router():
    args = router_args(render({"pools": {"prefill": {"tp": 2}}}))
    assert (flag(args, "--prefill-tp"), flag(args, "--decode-tp")) == ("2", "1")
    assert flag(router_args(render(merged(SCENARIOS["colocated"], {"colocated": {"tp": 2}}))), "--decode-tp") == "2"


def test_colocated_mode():
    docs = render(SCENARIOS["colocated"])
    assert components(docs) == {"ray-head", "colocated", "router"}
    args = router_args(docs)
    assert flag(args, "--colocated") == "3" and "--prefill" not in args and "--decode" not in args
    assert find(docs, "Deployment", "colocated")["spec"]["replicas"] == 3


def test_gpu_values_give_each_worker_one_gpu():
    docs = render(gpu_values())
    assert flag(router_args(docs), "--dtype") == "bfloat16"
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", role)
        c = container(dep)
        assert c["resources"]["limits"][GPU] == 1 and c["image"] == "tandem:cuda"
        assert "--num-gpus=1" in c["args"] and "--num-cpus=4" in c["args"]
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in dep["spec"]["template"]["spec"]["tolerations"]
    for role in ("router", "ray-head"):
        assert GPU not in json.dumps(find(docs, "Deployment", role))
    colocated = container(find(render(merged(gpu_values(), SCENARIOS["colocated"])), "Deployment", "colocated"))
    assert colocated["resources"]["limits"][GPU] == 1 and "--num-gpus=1" in colocated["args"]


def token_env(docs: list[dict]) -> dict:
    [env] = [e for e in container(find(docs, "Deployment", "router"))["env"] if e["name"] == "TANDEM_AUTH_TOKEN"]
    return env["valueFrom"]["secretKeyRef"]


def test_auth_from_a_created_secret():
    docs = render(SCENARIOS["auth-created"])
    ref = token_env(docs)
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == ref["name"]
    assert base64.b64decode(secret["data"][ref["key"]]) == b"s3cret"
    assert "TANDEM_AUTH_TOKEN" in manifests(SCENARIOS["auth-created"])["tandem/templates/NOTES.txt"]


def test_auth_from_an_existing_secret():
    docs = render(SCENARIOS["auth-existing"])
    assert token_env(docs) == {"name": "my-token", "key": "api-key"}
    assert not [d for d in docs if d["kind"] == "Secret"]


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
