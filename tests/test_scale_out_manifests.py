"""The deployment manifests of docs/scale-out.md, parsed and checked without a cluster: what
refers to what (selectors, ports, volumes, claims, the serving runtime), the probes, the GPU
requests, and the engine parameters they set, validated as the Triton model validates them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from minisgl_backend.serving.settings import triton_parameters
from minisgl_backend.settings import EngineSettings, parse_text, specs_of

REPO_ROOT = Path(__file__).resolve().parents[1]
DEPLOY = REPO_ROOT / "deploy"
GPU = "nvidia.com/gpu"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        docs += [(str(path.relative_to(REPO_ROOT)), doc)
                 for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> the manifest."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path, doc in _documents():
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in found, f"{key} declared twice"
        found[key] = doc
    return found


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == name)


def _port(container: dict[str, Any], port: int | str) -> int:
    """A container port by number or name."""
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if isinstance(port, str):
        assert port in ports, f"{container['name']} has no port {port!r}"
        return ports[port]
    assert port in ports.values(), f"{container['name']} does not expose {port}"
    return port


def _mount_of(container: dict[str, Any], path: str) -> str:
    """The volume mounted where `path` lies."""
    mounts = [m for m in container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume of {container['name']}"
    return max(mounts, key=lambda m: len(m["mountPath"]))["name"]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _check_http_probe(container: dict[str, Any], probe: str, path: str) -> int:
    get = container[probe]["httpGet"]
    assert get["path"] == path, (container["name"], probe)
    return _port(container, get["port"])


def _check_gpu(resources: dict[str, Any]) -> None:
    assert int(resources["limits"][GPU]) >= 1
    assert resources["requests"].get(GPU, resources["limits"][GPU]) == resources["limits"][GPU]


def test_replicas_serve_tritonserver_with_probes_gpus_and_the_front_door(manifests) -> None:
    deployment = manifests[("Deployment", "minisgl")]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] >= 2
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    server = _container(pod, "tritonserver")
    http = _check_http_probe(server, "readinessProbe", "/v2/health/ready")
    assert f"--http-port={http}" in server["args"]
    assert _check_http_probe(server, "livenessProbe", "/v2/health/live") == http
    assert f"--metrics-port={_port(server, 'metrics')}" in server["args"]
    _check_gpu(server["resources"])
    front = _container(pod, "openai")
    assert front["command"] == ["python", "-m", "minisgl_backend.openai_server"]
    assert int(_env(front)["OPENAI_PORT"]) == _port(front, "openai") == 9000
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, (container["name"], mount["name"])
    annotations = spec["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == _port(server, "metrics")


def test_the_model_folder_comes_from_a_volume_and_the_parameters_are_valid(manifests) -> None:
    pod = manifests[("Deployment", "minisgl")]["spec"]["template"]["spec"]
    server = _container(pod, "tritonserver")
    volumes = {v["name"]: v for v in pod["volumes"]}
    parameters = manifests[("ConfigMap", "minisgl-parameters")]["data"]
    known = triton_parameters()
    assert parameters.keys() <= known.keys(), parameters.keys() - known.keys()
    values = {name: parse_text(name, known[name][0], text) for name, text in parameters.items()}
    engine = EngineSettings(**{k: v for k, v in values.items() if k in specs_of(EngineSettings)})
    assert engine.kv_events_endpoint and engine.page_size >= 16
    claim = volumes[_mount_of(server, parameters["model"])]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in manifests
    for setting, port_name in (("kv_events_endpoint", "kv-events"),
                               ("kv_events_replay_endpoint", "kv-replay")):
        endpoint = getattr(engine, setting)
        assert "*" in endpoint, f"{setting}: routers connect to it, so it binds"
        assert int(endpoint.rsplit(":", 1)[1]) == _port(server, port_name)
    (repository,) = [a.split("=", 1)[1] for a in server["args"]
                     if a.startswith("--model-repository=")]
    init = _container({"containers": pod["initContainers"]}, "model-repository")
    assert _mount_of(init, repository) == _mount_of(server, repository)
    assert _mount_of(init, "/parameters") == "parameters"
    assert volumes["parameters"]["configMap"]["name"] == "minisgl-parameters"
    script = init["args"][0]
    assert f"{repository.removeprefix('/model-repository/')}/minisgl/config.pbtxt" in script


def test_services_and_the_inference_pool_select_the_replicas(manifests) -> None:
    template = manifests[("Deployment", "minisgl")]["spec"]["template"]
    labels, pod = template["metadata"]["labels"], template["spec"]
    named = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    for name in ("minisgl", "minisgl-pods"):
        service = manifests[("Service", name)]["spec"]
        assert service["selector"].items() <= labels.items()
        for port in service["ports"]:
            assert port["targetPort"] in named, (name, port)
    assert manifests[("Service", "minisgl-pods")]["spec"]["clusterIP"] == "None"
    pool = manifests[("InferencePool", "minisgl")]["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["targetPorts"]] == [named["openai"]]
    assert pool["endpointPickerRef"]["name"]
    route = manifests[("HTTPRoute", "minisgl")]["spec"]
    refs = [b for rule in route["rules"] for b in rule["backendRefs"]]
    assert {(b["kind"], b["name"]) for b in refs} == {("InferencePool", "minisgl")}


def test_the_inference_service_uses_the_triton_runtime(manifests) -> None:
    service = manifests[("InferenceService", "minisgl")]["spec"]["predictor"]
    model = service["model"]
    runtime = manifests[("ServingRuntime", model["runtime"])]["spec"]
    formats = {f["name"] for f in runtime["supportedModelFormats"]}
    assert model["modelFormat"]["name"] == "triton" and "triton" in formats
    (container,) = runtime["containers"]
    assert container["command"] == ["tritonserver"]
    assert "--model-repository=/mnt/models" in container["args"]
    ready = container["readinessProbe"]["httpGet"]
    assert ready["path"] == "/v2/health/ready" and f"--http-port={ready['port']}" in \
        container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    claim = re.fullmatch(r"pvc://([^/]+)/.+", model["storageUri"])
    assert claim and ("PersistentVolumeClaim", claim[1]) in manifests
    _check_gpu(model["resources"])
    assert 2 <= service["minReplicas"] <= service["maxReplicas"]


def test_the_guide_names_its_files_and_metrics_and_the_readme_links_it() -> None:
    guide = (REPO_ROOT / "docs" / "scale-out.md").read_text()
    for path in sorted(DEPLOY.rglob("*.yaml")):
        assert str(path.relative_to(REPO_ROOT)) in guide, path
    published = (REPO_ROOT / "minisgl_backend" / "serving" / "metrics.py").read_text()
    table = re.findall(r"^\| `(vllm:[a-z_]+)`", guide, re.MULTILINE)  # the metrics table
    assert len(table) >= 5
    for name in table:
        assert f'"{name}"' in published, f"{name} is in the guide's table but not published"
    assert "docs/scale-out.md" in (REPO_ROOT / "README.md").read_text()
