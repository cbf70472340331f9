"""deploy/: the Dockerfile and Kubernetes manifests agree with the server they run: ports, probe
paths, the drain's timing, CLI options and the metric names the autoscaler queries."""
import json
import re
from pathlib import Path

import pytest
import yaml

from kiln.serve.app import ServeConfig, build_app
from kiln.serve.cli import serve
from kiln.serve.metrics import METRIC_NAMES, VLLM_METRIC_NAMES

DEPLOY = Path(__file__).parent.parent / "deploy"


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    docs = [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def pod(manifests):
    return manifests["Deployment"]["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod):
    (c,) = pod["spec"]["containers"]
    return c


def options(args: list[str]) -> dict[str, str]:
    out = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            out[name.replace("-", "_")] = value if eq else (args[i + 1] if i + 1 < len(args)
                                                            and not args[i + 1].startswith("--") else "")
    return out


def serve_option_names() -> set[str]:
    return {o.lstrip("-").replace("-", "_") for p in serve.params for o in (*p.opts, *p.secondary_opts)}


def dockerfile() -> dict[str, str]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    return {m.group(1): m.group(2) for m in re.finditer(r"^(ENTRYPOINT|CMD|ENV|EXPOSE|HEALTHCHECK|STOPSIGNAL) (.*)$",
                                                          text, re.M)}


def test_server_has_the_routes_the_probes_use():
    paths = {r.path for r in build_app(ServeConfig("unused")).routes}
    assert {"/health", "/metrics", "/v1/completions", "/v1/chat/completions", "/v1/models"} <= paths


def test_dockerfile_runs_kiln_serve_on_its_exposed_port(container):
    d = dockerfile()
    entry = json.loads(d["ENTRYPOINT"]) + json.loads(d["CMD"])
    assert entry[:2] == ["kiln", "serve"]
    opts = options(entry[2:])
    assert set(opts) <= serve_option_names()
    port = int(opts["port"])
    assert d["EXPOSE"].split() == [str(port)]
    assert f"127.0.0.1:{port}/health" in d["HEALTHCHECK"] and d["STOPSIGNAL"] == "SIGTERM"
    # the Deployment runs this image's entrypoint and only adds options to it
    assert "command" not in container
    assert {p["containerPort"] for p in container["ports"]} == {port}


def test_deployment_probes_ports_and_scrape_annotations(pod, container):
    port = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert port.get(get["port"], get["port"]) == 8000, probe
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == port["http"]
    # the startup probe waits long enough for an engine to load
    s = container["startupProbe"]
    assert s["periodSeconds"] * s["failureThreshold"] >= 300


def test_grace_period_covers_the_drain(pod, container):
    opts = options(container["args"])
    assert set(opts) <= serve_option_names(), set(opts) - serve_option_names()
    drain = float(opts["drain_timeout"])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep = float(pre_stop[1])
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= sleep + drain + 5, "SIGKILL would cut the drain short"
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= sleep + drain, \
        "the liveness probe would restart a draining pod (/health is 503 while draining)"
    ready = container["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= sleep, \
        "the pod should leave the Service before the preStop sleep ends"
    env = {e["name"] for e in container.get("env", [])}
    api_key = next(p for p in serve.params if p.name == "api_key")
    assert api_key.envvar in env


def test_engines_unpack_into_a_bounded_emptydir(pod, container, monkeypatch):
    """The server unpacks its engine under $KILN_CACHE_DIR/extracted (kiln/engine/extraction.py):
    the pod mounts an emptyDir with a size limit exactly there, not over the image's cache root,
    which holds the C++ plugin library built into the image."""
    from kiln.engine import extraction

    cache_root = re.search(r"\bKILN_CACHE_DIR=(\S+)", dockerfile()["ENV"]).group(1)
    monkeypatch.setenv("KILN_CACHE_DIR", cache_root)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert cache_root not in mounts
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mounts[str(extraction.area())])
    assert volume["emptyDir"]["sizeLimit"]


def test_service_targets_the_container(manifests, pod, container):
    svc = manifests["Service"]["spec"]
    assert svc["selector"].items() <= pod["metadata"]["labels"].items()
    names = {p["name"]: p["containerPort"] for p in container["ports"]}
    (p,) = svc["ports"]
    assert names.get(p["targetPort"], p["targetPort"]) == 8000


def test_autoscaler_queries_the_servers_metrics(manifests, container):
    so = manifests["ScaledObject"]["spec"]
    assert so["scaleTargetRef"]["name"] == manifests["Deployment"]["metadata"]["name"]
    (trigger,) = so["triggers"]
    query = trigger["metadata"]["query"]
    used = set(re.findall(r"(?:kiln|vllm):[a-z_]+", query))
    assert used == {"vllm:num_requests_waiting"} and used <= set(METRIC_NAMES + VLLM_METRIC_NAMES)
    served = options(container["args"])["served_model_name"]
    assert f'model_name="{served}"' in query  # the label the server puts on every series
    assert float(trigger["metadata"]["threshold"]) > 0
