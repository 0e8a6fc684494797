"""The Helm chart's router: the flags it passes to `tandem serve`, its ports, probes and
install notes, and how pool sizes, policies, tensor parallelism and GPUs reach it."""

from __future__ import annotations

import argparse
import json

import pytest
from helm_render import (
    GPU,
    HEAD,
    SCENARIOS,
    components,
    container,
    find,
    flag,
    gpu_values,
    manifests,
    merged,
    render,
    router_args,
)

from tandem.cli import build_parser
from tandem.model.source import DEFAULT_MODEL_NAME, resolve_model_source
from tandem.router import serve_command
from tandem.router.policy import POLICIES
from tandem.router.server import LIVENESS_SERVICE


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
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": 50051, "service": ""}
    assert c["livenessProbe"]["grpc"] == {"port": 50051, "service": LIVENESS_SERVICE}
    assert router["spec"]["strategy"]["type"] == "Recreate"
    assert "TANDEM_AUTH_TOKEN" not in {e["name"] for e in c["env"]}
    annotations = router["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9464",
                           "prometheus.io/path": "/metrics"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9464, "http": 8000}
    svc = find(docs, "Service", "router")
    assert svc["spec"]["type"] == "ClusterIP"
    assert {p["name"]: (p["port"], p["targetPort"], p["appProtocol"]) for p in svc["spec"]["ports"]} == {
        "grpc": (50051, "grpc", "grpc"), "metrics": (9464, "metrics", "http"), "http": (8000, "http", "http")}
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]
    secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert secrets == ["demo-tandem-admin", "demo-tandem-ray-auth"]  # the admin key's and Ray's only


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
        assert c[probe]["grpc"]["port"] == 50052  # the probes stay on gRPC
    assert router["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    svc = find(docs, "Service", "router")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "grpc": (50052, "grpc"), "metrics": (9100, "metrics"), "http": (8080, "http")}
    values = {"router": {"grpcPort": 50052, "metricsPort": 9100, "httpPort": 8080}}
    notes = manifests(values)["tandem/templates/NOTES.txt"]
    assert "port-forward service/demo-tandem-router 8080:8080" in notes
    assert "curl -s 127.0.0.1:8080/v1/chat/completions " in notes and ":8000" not in notes


def notes_curl(values: dict) -> tuple[str, dict]:
    """The install notes' curl line for the OpenAI API, and the JSON body it sends."""
    [line] = [note.strip() for note in manifests(values)["tandem/templates/NOTES.txt"].splitlines()
              if note.strip().startswith("curl ")]
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
    for model in (tmp_path / "Qwen2-0.5B-Instruct", f"{tmp_path}/Qwen2-0.5B-Instruct/",
                  tmp_path / "tiny-llama.Q4_0.gguf"):
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
        tolerations = dep["spec"]["template"]["spec"]["tolerations"]
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in tolerations
    for role in ("router", "ray-head"):
        assert GPU not in json.dumps(find(docs, "Deployment", role))
    colocated = container(find(render(merged(gpu_values(), SCENARIOS["colocated"])), "Deployment", "colocated"))
    assert colocated["resources"]["limits"][GPU] == 1 and "--num-gpus=1" in colocated["args"]


def test_router_tls_from_a_secret():
    """router.tls.secretName: the certificate is mounted and passed to `tandem serve`; the
    probes become `tandem health` over TLS (a command the CLI parses), each on its service."""
    docs = render({"router": {"tls": {"secretName": "router-tls"}}})
    args = router_args(docs)
    assert (flag(args, "--tls-certfile"), flag(args, "--tls-keyfile")) == ("/etc/tandem/tls/tls.crt",
                                                                          "/etc/tandem/tls/tls.key")
    router = find(docs, "Deployment", "router")
    c = container(router)
    assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in c["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "router-tls"}} in router["spec"]["template"]["spec"]["volumes"]
    services = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["tandem", "health"] and "grpc" not in c[probe]
        parsed = build_parser().parse_args(command[1:])
        assert (parsed.server, parsed.tls_ca, parsed.tls_server_name) == (
            "127.0.0.1:50051", "/etc/tandem/tls/ca.crt", "demo-tandem-router")
        services[probe] = parsed.service
    assert services == {"startupProbe": "", "readinessProbe": "", "livenessProbe": LIVENESS_SERVICE}
    plain = container(find(render(), "Deployment", "router"))
    assert "volumeMounts" in plain and all(m["name"] != "tls" for m in plain["volumeMounts"])
