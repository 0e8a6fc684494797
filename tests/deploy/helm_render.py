"""Rendering the Helm chart (deploy/helm/tandem) in tests, and finding things in what it renders.

`manifests(values)` is `helm template` through helm-python-sdk (Helm's Go SDK bound through
ctypes, no helm binary): template path -> text. `render(values)` parses those into objects;
`find`, `container`, `flag` and `components` pick out Deployments, Services and arguments.
Used by test_helm.py and test_helm_router.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import helm_python
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tandem"
RELEASE, NAMESPACE = "demo", "serving"
HEAD = f"{RELEASE}-tandem-ray-head:6379"
GPU = "nvidia.com/gpu"


def merged(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def gpu_values() -> dict:
    return yaml.safe_load((CHART / "values-gpu.yaml").read_text())


def manifests(values: dict | None = None, release: str = RELEASE) -> dict[str, str]:
    """`helm template`: template path -> rendered text, with these values on top of values.yaml."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values or {}, name=release, namespace=NAMESPACE)


def render(values: dict | None = None, release: str = RELEASE) -> list[dict]:
    """Every object the chart renders."""
    docs = []
    for path, text in sorted(manifests(values, release).items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d is not None]
    return docs


def find(docs: list[dict], kind: str, component: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return doc


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def components(docs: list[dict], kind: str = "Deployment") -> set[str]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in docs if d["kind"] == kind}


SCENARIOS = {
    "default": {},
    "gpu": gpu_values(),
    "colocated": {"mode": "colocated", "colocated": {"replicas": 3}},
    "auth-created": {"auth": {"token": "s3cret"}},
    "auth-existing": {"auth": {"existingSecret": "my-token", "existingSecretKey": "api-key"}},
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}}},
    "model-volume": {"model": "/models/qwen2", "modelVolume": {"existingClaim": "models"}},
    "kv-encryption": {"kvTransfer": {"encryption": {"enabled": True}}},
    "hub-model": {"model": "Qwen/Qwen2.5-0.5B-Instruct", "modelRevision": "v1", "hf": {"tokenSecret": "hf"},
                  "router": {"extraArgs": ["--served-model-name", "qwen"], "env": [{"name": "A", "value": "1"}]},
                  "pools": {"decode": {"env": [{"name": "B", "value": "2"}]},
                            "prefill": {"extraArgs": ["--object-store-memory=100000000"]}}},
}
"""Values every chart-wide check runs on (the `rendered` fixture of conftest.py)."""


def router_args(docs: list[dict]) -> list[str]:
    router = container(find(docs, "Deployment", "router"))
    assert router["command"][:2] == ["sh", "-c"] and f"ray start --address={HEAD}" in router["command"][2]
    assert 'exec tandem "$@"' in router["command"][2]
    return router["args"]
