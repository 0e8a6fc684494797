"""The chart takes worker pods down without failing a request: each worker pod's preStop hook
runs `tandem drain --node-ip $MY_POD_IP --replace` against the router (with the admin key),
inside a grace period that covers a replacement's start and the drain, and worker Deployments
roll one surge pod at a time (a free pod for the replacement). The router and the hooks share
one admin key; the drain itself is tests/cluster/test_pool_changes_cluster.py's."""

from __future__ import annotations

import base64
import shlex

from helm_render import RELEASE, container, find, render

from tandem import cli

ROUTER_URL = f"http://{RELEASE}-tandem-router:8000"


def admin_key_ref(deployment: dict) -> dict:
    [env] = [e for e in container(deployment)["env"] if e["name"] == "TANDEM_ADMIN_API_KEY"]
    return env["valueFrom"]["secretKeyRef"]


def pre_stop(deployment: dict) -> list[str]:
    """The preStop hook's command line, as its shell splits it."""
    sh, dash_c, line = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert (sh, dash_c) == ("sh", "-c")
    return shlex.split(line)


def test_every_worker_pod_drains_its_workers_before_it_stops():
    docs = render({"drain": {"timeoutSeconds": 45, "replacementStartSeconds": 200}})
    for role in ("prefill", "decode"):
        workers = find(docs, "Deployment", role)
        words = pre_stop(workers)
        assert words == ["tandem", "drain", "--node-ip", "$MY_POD_IP", "--replace", "--timeout-s", "45",
                         "--url", ROUTER_URL]
        # the words are tandem's own: its parser takes them (the pod's IP as the shell gives it)
        args = cli.build_parser().parse_args(["10.1.2.3" if w == "$MY_POD_IP" else w for w in words[1:]])
        assert (args.node_ip, args.replace, args.timeout_s, args.url) == ("10.1.2.3", True, 45.0, ROUTER_URL)
        assert workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 45 + 200 + 30
        assert workers["spec"]["strategy"] == {"type": "RollingUpdate",
                                               "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_the_router_and_the_hooks_share_one_admin_key():
    docs = render()
    refs = [admin_key_ref(find(docs, "Deployment", c)) for c in ("router", "prefill", "decode")]
    assert refs == [{"name": f"{RELEASE}-tandem-admin", "key": "key"}] * 3
    [secret] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{RELEASE}-tandem-admin"]
    assert len(base64.b64decode(secret["data"]["key"])) == 48  # random, not empty

    docs = render({"admin": {"existingSecret": "ops-admin", "existingSecretKey": "k"}})
    assert admin_key_ref(find(docs, "Deployment", "decode")) == {"name": "ops-admin", "key": "k"}
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{RELEASE}-tandem-admin"]


def test_with_tls_the_hook_checks_the_routers_certificate():
    decode = find(render({"router": {"tls": {"secretName": "router-tls"}}}), "Deployment", "decode")
    words = pre_stop(decode)
    assert words[words.index("--url") + 1] == f"https://{RELEASE}-tandem-router:8000"
    assert words[words.index("--tls-ca") + 1] == "/etc/tandem/tls/ca.crt"
    assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in container(decode)["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "router-tls"}} in decode["spec"]["template"]["spec"]["volumes"]


def test_drain_off_leaves_no_hook():
    decode = find(render({"drain": {"enabled": False}}), "Deployment", "decode")
    assert "lifecycle" not in container(decode)
    assert "terminationGracePeriodSeconds" not in decode["spec"]["template"]["spec"]
