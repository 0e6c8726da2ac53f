"""The GPU deployment files, checked offline (no Docker engine here)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _installed(program: str, why: str) -> str:
    """The path of `program`; the test fails (not skips) without it, saying `why` it is needed."""
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is not installed: {why}")
    return path


def _compose() -> str:
    return _installed("docker-compose", "scripts/setup.sh installs Debian's docker-compose package")


def test_compose_file_is_valid():
    result = subprocess.run([_compose(), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_compose_serves_the_local_binary_release_on_a_gpu():
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    triton, builder = spec["services"]["triton"], spec["services"]["engine-builder"]
    assert builder["image"] == "nvcr.io/nvidia/tensorrt:24.10-py3"  # trtexec of Triton 2.51's TensorRT
    assert "tritonserver:24.10-py3" in (ROOT / "docker" / "Dockerfile").read_text()  # = the wheel's binary
    assert triton["restart"] == "on-failure:3"  # a model that fails to load is reported, not restarted forever
    # inference public; metrics (they name every task) and the supervisor's health port on loopback only
    assert set(triton["ports"]) == {"8000:8000", "8001:8001", "127.0.0.1:8002:8002", "127.0.0.1:8003:8003"}
    assert "localhost:8003/ready" in " ".join(triton["healthcheck"]["test"])  # the truthful readiness
    assert triton["secrets"] == ["aot_admin_key"] and spec["secrets"]["aot_admin_key"]["file"]
    assert triton["environment"]["AOT_ADMIN_KEY_FILE"] == "/run/secrets/aot_admin_key"
    assert triton["depends_on"]["engine-builder"]["condition"] == "service_completed_successfully"
    for service in (triton, builder):
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert "--model-repository=/repo/models" in triton["command"]


def test_dockerfile_installs_only_the_pinned_serving_extra():
    """The image gets `aot.serving`, `aot.serving_torch` and the model files, the [serve] and [serve-torch] extras
    pinned, and no training code."""
    import re

    import tomllib

    text = (ROOT / "docker" / "Dockerfile").read_text()
    for package in ("serving", "serving_torch", "model_repository"):
        assert f"COPY aot/{package} ./aot/{package}" in text
    for package in ("cli", "client", "local", "training", "exporter", "benchmarks"):
        assert f"COPY aot/{package} " not in text
    assert "COPY aot " not in text and 'python3 -c "import aot.serving_torch.engine"' in text
    pins = dict(re.findall(r"([a-z_]+)==([0-9.]+)", text))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for requirement in extras["serve"] + extras["serve-torch"]:
        name = re.match(r"[a-z_-]+", requirement).group(0)
        if name != "aot-ptuning":
            assert name in pins, f"{name} of the [serve] / [serve-torch] extras is not pinned in the Dockerfile"
    assert pins["numpy"].startswith("1.")


def test_the_image_copies_every_module_the_served_code_imports():
    """`docker build` runs the served steps' imports: every `aot` module that aot.serving, aot.serving_torch and the
    model templates import (aot.settings since the one settings module) must be copied, or the build fails."""
    import ast

    text = (ROOT / "docker" / "Dockerfile").read_text()
    copied = {m for line in re.findall(r"^COPY (.+) \./aot/?\S*$", text, re.M) for m in line.split()}
    imported = set()
    for package in ("serving", "serving_torch", "model_repository"):
        for path in (ROOT / "aot" / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                if isinstance(node, ast.ImportFrom) and node.module == "aot":
                    names = [f"aot.{a.name}" for a in node.names]
                imported |= {n.split(".")[1] for n in names if n.startswith("aot.")}
    assert {"serving", "settings"} <= imported
    for module in sorted(imported):
        assert f"aot/{module}" in copied or f"aot/{module}.py" in copied, f"docker/Dockerfile does not copy aot.{module}"


def test_compose_runs_tritonserver_under_the_supervisor():
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = spec["services"]["triton"]["command"]
    assert command[:4] == ["python3", "-m", "aot.serving", "tritonserver"]


@pytest.mark.parametrize("engine", ["onnx", "torch"])
def test_compose_env_of_a_repository_sizes_the_memory_pools(tmp_path, tiny_models, engine):
    """`docker compose --env-file REPO/compose.env` resolves the repository, its engine's image and the memory pools
    computed from its largest batch (validated offline by docker-compose)."""
    import os

    from aot.serving.repository import memory_pool_bytes, read_repository
    from tests.helpers import make_repository

    repo = make_repository(tiny_models["bert"], tmp_path / "repo", {}, engine=engine)
    written = (repo / "compose.env").read_text()
    assert str(tmp_path) not in written and "=/" not in written  # no path of the exporting machine
    served = tmp_path / "elsewhere"  # the copy on the serving machine, named there
    repo.rename(served)
    result = subprocess.run([_compose(), "--env-file", str(served / "compose.env"), "-f",
                             str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True,
                            env={**os.environ, "AOT_REPO": str(served)})
    assert result.returncode == 0, result.stderr
    spec = yaml.safe_load(result.stdout)
    triton = spec["services"]["triton"]
    pools = memory_pool_bytes(read_repository(served))
    assert f"--cuda-memory-pool-byte-size=0:{pools['cuda']}" in triton["command"]
    assert f"--pinned-memory-pool-byte-size={pools['pinned']}" in triton["command"]
    volumes = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in triton["volumes"]]
    assert any(v.startswith(f"{served.resolve()}:/repo") for v in volumes), volumes
    assert spec["secrets"]["aot_admin_key"]["file"] == str(served.resolve() / "admin-key")


def _gpu_check(*stages, **env):
    import os

    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), *stages], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_gpu_check_usage_names_its_stages_and_perf_is_the_default(tmp_path):
    out = _gpu_check("--help", OUT=str(tmp_path / "out"))
    assert out.returncode == 0 and "default: perf" in out.stdout
    assert all(f"#     {stage} " in out.stdout for stage in ("perf", "smoke", "serve", "pool", "overhead"))


@pytest.mark.parametrize("stages,kit,said", [
    pytest.param((), "no-kit", ("no-kit: run bash scripts/gpu-kit.sh",), id="no stage: perf, no kit"),
    pytest.param(("smoke", "warp"), None,
                 ("unknown stage 'warp': expected perf, smoke, serve, pool or overhead",), id="unknown stage"),
    pytest.param(("smoke",), "no-kit", ("no-kit: run bash scripts/gpu-kit.sh",), id="no kit"),
    pytest.param(("perf",), "kit", ("has no perf-analyzer/ wheel", "rebuild it with bash scripts/gpu-kit.sh"),
                 id="a kit without perf_analyzer"),
])
def test_gpu_check_refuses_what_it_cannot_run(tmp_path, stages, kit, said):
    """scripts/gpu-check.sh (the GPU run, docs/benchmarks.md, "GPU serving: the torch engine") names what is wrong
    before it sets anything up."""
    (tmp_path / "kit").mkdir()
    out = _gpu_check(*stages, OUT=str(tmp_path / "out"), AOT_GPU_DEVICE="cuda",
                     **({"AOT_GPU_KIT": str(tmp_path / kit)} if kit else {}))
    assert out.returncode == 2 and all(words in out.stderr for words in said), out.stderr


def test_gpu_check_refuses_a_kit_for_another_python(tmp_path):
    """A kit built for another Python is refused before anything is set up (no work folder), in the log too."""
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "python-version").write_text("2.7\n")
    out = _gpu_check("smoke", AOT_GPU_KIT=str(kit), OUT=str(tmp_path / "out"), AOT_GPU_WORK=str(tmp_path / "work"))
    assert out.returncode == 2 and "the kit is for 2.7" in out.stdout  # from here on, the log has it too
    assert "the kit is for 2.7" in (tmp_path / "out" / "gpu-check.log").read_text()
    assert not (tmp_path / "work" / "client").exists()


KUBERNETES = "1.32.0"  # kubectl's version on these machines; the manifests use no API newer than it


def _render(folder: str) -> dict[str, dict]:
    """A folder of deploy/kubernetes rendered offline by kubectl's Kustomize: kind -> object (the Services by name)."""
    kubectl = _installed("kubectl", "it renders deploy/kubernetes (kubectl kustomize)")
    result = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / folder)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    objects = {}
    for doc in yaml.safe_load_all(result.stdout):
        objects[doc["metadata"]["name"] if doc["kind"] == "Service" else doc["kind"]] = doc
    return objects


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    return _render("kubernetes")


def test_kubernetes_manifests_validate_against_the_schemas(rendered):
    import kubernetes_validate

    assert set(rendered) == {"Namespace", "ConfigMap", "aot-triton", "aot-triton-headless", "PersistentVolumeClaim",
                             "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for doc in rendered.values():
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises naming the field


def test_kubernetes_fleet_serves_the_shared_store_safely(rendered):
    """The Deployment's promises: the supervisor's truthful probes, non-root on a read-only root, a GPU each, the
    store read-only on a ReadWriteMany volume, the admin key from a Secret, rolling updates with no replica down,
    and a new backbone (the repository ConfigMap) a new revision."""
    deployment = rendered["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [triton] = pod["containers"]
    assert triton["command"] == ["python3", "-m", "aot.serving", "tritonserver"]
    assert triton["image"] == "aot-ptuning-triton:24.10"  # docker/Dockerfile's image, as docker-compose.yml tags it
    for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"), ("livenessProbe", "/live")):
        assert triton[probe]["httpGet"] == {"path": path, "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "health": 8003}
    env = {e["name"]: e.get("value") for e in triton["env"]}
    assert env["AOT_HEALTH_PORT"] == str(ports["health"]) and env["AOT_ADMIN_KEY_FILE"] == "/run/secrets/aot/admin-key"
    assert pod["securityContext"]["runAsNonRoot"] is True and triton["securityContext"]["readOnlyRootFilesystem"]
    assert triton["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in triton["volumeMounts"]}
    assert volumes["repository"]["persistentVolumeClaim"]["claimName"] == rendered["PersistentVolumeClaim"]["metadata"]["name"]
    assert mounts["repository"]["readOnly"] is True and mounts["admin-key"]["readOnly"] is True
    assert rendered["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volumes["admin-key"]["secret"]["secretName"] == "aot-admin-key"
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    configmap = rendered["ConfigMap"]["metadata"]["name"]
    assert configmap.startswith("aot-repository-") and triton["envFrom"] == [{"configMapRef": {"name": configmap}}]
    assert "--model-repository=/mnt/aot/$(AOT_REPOSITORY)/models" in triton["args"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


def test_the_first_deployment_applies_the_namespace_and_claim_alone_first():
    """docs/deploy-kubernetes.md's first deployment applies the namespace and the claim alone (by a label selector)
    before the Secret that lives in the namespace and the repository that goes on the claim: the selector picks
    exactly those two objects, and the steps come in that order."""
    doc = (ROOT / "docs" / "deploy-kubernetes.md").read_text()
    steps = doc[doc.index("## A first deployment, step by step"):]
    selector = re.search(r"kubectl apply -k deploy/kubernetes -l '(\S+) in \(([^)]*)\)'", steps)
    assert selector, "no first apply by label in the first deployment"
    key, values = selector[1], selector[2].split(",")
    kubectl = _installed("kubectl", "it renders deploy/kubernetes (kubectl kustomize)")
    result = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / "kubernetes")], capture_output=True, text=True)
    picked = [d["kind"] for d in yaml.safe_load_all(result.stdout) if (d["metadata"].get("labels") or {}).get(key)
              in values]
    assert sorted(picked) == ["Namespace", "PersistentVolumeClaim"]
    order = [steps.index(s) for s in (selector[0], "create secret generic aot-admin-key", "tar -C runs/repo",
                                      "\nkubectl apply -k deploy/kubernetes\n", "docker build -f docker/Dockerfile -t")]
    assert order[:4] == sorted(order[:4]) and order[4] < order[0]


def test_kubernetes_services_budget_and_autoscaler(rendered):
    """Inference only behind the Services (metrics name every task), at most one replica disrupted, and the
    autoscaler on the backbone's queue time per request, not a per-model average."""
    for name in ("aot-triton", "aot-triton-headless"):
        assert {p["port"] for p in rendered[name]["spec"]["ports"]} <= {8000, 8001}
    assert rendered["aot-triton-headless"]["spec"]["clusterIP"] == "None"
    selector = rendered["Deployment"]["spec"]["selector"]["matchLabels"]
    assert rendered["PodDisruptionBudget"]["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    hpa = rendered["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == rendered["Deployment"]["metadata"]["name"]
    assert hpa["minReplicas"] >= 2  # with one, a disruption or a rollout leaves none
    [metric] = hpa["metrics"]
    assert metric["pods"]["metric"]["name"] == "aot_backbone_queue_seconds"


def _parameters() -> dict[str, str]:
    lines = (ROOT / "deploy" / "kubernetes" / "base" / "parameters.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_storage_class_is_a_parameter(rendered):
    """The claim's storageClassName comes from base/parameters.env (a ReadWriteMany class is cluster-specific), and
    the parameters are read while rendering, never applied."""
    assert rendered["PersistentVolumeClaim"]["spec"]["storageClassName"] == _parameters()["STORAGE_CLASS"]
    assert rendered["ConfigMap"]["metadata"]["name"].startswith("aot-repository-")  # the only ConfigMap applied


def test_cpu_overlay_serves_the_cpu_configs_without_gpus():
    """deploy/kubernetes/cpu: the same fleet with no GPU request anywhere, the CPU configs (the fused step and the
    task list, as aot serve loads them), and an autoscaler on CPU utilisation, valid against the 1.32 schemas."""
    import kubernetes_validate

    cpu, gpu = _render("kubernetes/cpu"), _render("kubernetes")
    assert set(cpu) == set(gpu)
    for doc in cpu.values():
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        assert "nvidia.com/gpu" not in yaml.safe_dump(doc) and "cuda-memory-pool" not in yaml.safe_dump(doc)
    [triton] = cpu["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert triton["command"] == ["python3", "-m", "aot.serving", "tritonserver"]
    assert triton["image"] == "aot-ptuning-triton:24.10"  # the NGC-based image runs on CPU nodes
    assert {"--model-config-name=cpu", "--model-control-mode=explicit", "--load-model=aot",
            "--load-model=task_list", "--model-repository=/mnt/aot/$(AOT_REPOSITORY)/models"} <= set(triton["args"])
    assert not any("vanilla" in a for a in triton["args"])
    assert triton["resources"]["requests"]["cpu"] and "nvidia.com/gpu" not in triton["resources"]["limits"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # the base's promises hold
        assert triton[probe] == gpu["Deployment"]["spec"]["template"]["spec"]["containers"][0][probe]
    [metric] = cpu["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric == {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                                                 "averageUtilization": 70}}}


def test_publish_job_writes_the_fleet_claim_with_the_export_image():
    """deploy/kubernetes/publish: one `aot export task` in the publisher image, on the fleet's claim mounted
    read-write (the replicas mount it read-only), never retried (a failed publish changes nothing), non-root."""
    import kubernetes_validate

    publish, fleet = _render("kubernetes/publish"), _render("kubernetes")
    assert set(publish) == {"ConfigMap", "Job"}
    for doc in publish.values():
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    job = publish["Job"]
    assert job["metadata"]["namespace"] == fleet["Deployment"]["metadata"]["namespace"]
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "aot-ptuning-publisher:0.1.0"
    assert container["command"] == ["aot", "export", "task"]
    assert {"--task=/mnt/aot/artifacts/$(AOT_TASK_ARTIFACT)", "--repo=/mnt/aot/$(AOT_REPOSITORY)",
            "--name=$(AOT_TASK_NAME)"} <= set(container["args"])
    config = publish["ConfigMap"]
    assert container["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
    assert {"AOT_REPOSITORY", "AOT_TASK_ARTIFACT", "AOT_TASK_NAME"} <= set(config["data"])
    claim = fleet["PersistentVolumeClaim"]["metadata"]["name"]
    [volume] = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {"claimName": claim}  # read-write
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == "/mnt/aot" and not mount.get("readOnly")
    assert pod["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]


def test_publisher_image_installs_the_pinned_export_extra():
    """docker/Dockerfile.publish: PyTorch's CPU wheel and every package of the [export] extra, pinned, and the
    project's code the exporter needs (no benchmarks), checked by running `aot export task --help` at build."""
    import re

    import tomllib

    text = (ROOT / "docker" / "Dockerfile.publish").read_text()
    pins = dict(re.findall(r"([a-z_-]+)(?:\[[a-z,]+\])?==([0-9.]+)", text))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("export", "train", "client"):
        for requirement in extras[extra]:
            name = re.match(r"[a-z_-]+", requirement).group(0)
            if name != "aot-ptuning":
                assert name in pins, f"{name} of the [{extra}] extra is not pinned in docker/Dockerfile.publish"
    assert "download.pytorch.org/whl/cpu" in text and pins["torch"] == "2.13.0"
    for package in ("cli", "client", "local", "serving", "serving_torch", "training", "exporter", "model_repository"):
        assert f"COPY aot/{package} ./aot/{package}" in text
    assert "COPY aot/benchmarks" not in text and "COPY aot " not in text and "aot export task --help" in text
    assert "USER 1000" in text  # as the Job's runAsUser and the replicas' triton-server user


@pytest.mark.parametrize("overlay, nodes", [("kubernetes/s3", "kubernetes"), ("kubernetes/s3-cpu", "kubernetes/cpu")])
def test_object_store_overlays_need_no_shared_volume(overlay, nodes):
    """deploy/kubernetes/s3 and s3-cpu: the GPU and CPU fleets with the task store in a bucket: no claim and no
    volume of it, the repository image (docker/Dockerfile.repository, the repository at /mnt/aot/$(AOT_REPOSITORY)
    as the unchanged args name it), the store's credentials from the Secret aot-s3, a task cache on an emptyDir
    larger than the cache's bound, valid against the 1.32 schemas; everything else as on a shared volume."""
    import kubernetes_validate

    s3, shared = _render(overlay), _render(nodes)
    assert set(s3) == set(shared) - {"PersistentVolumeClaim"}
    for doc in s3.values():
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    pod = s3["Deployment"]["spec"]["template"]["spec"]
    [triton] = pod["containers"]
    [shared_triton] = shared["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert triton["image"] == "aot-ptuning-repository:demo"
    assert triton["args"] == shared_triton["args"] and triton["resources"] == shared_triton["resources"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "repository" not in volumes and not any("persistentVolumeClaim" in v for v in volumes.values())
    mounts = {m["mountPath"]: m["name"] for m in triton["volumeMounts"]}
    assert "/mnt/aot" not in mounts  # the image's own /mnt/aot/NAME
    env = {e["name"]: e.get("value") for e in triton["env"]}
    assert mounts[env["AOT_TASK_CACHE_DIR"]] == "task-cache"
    limit = volumes["task-cache"]["emptyDir"]["sizeLimit"]
    assert limit.endswith("Gi") and int(env["AOT_TASK_CACHE_BYTES"]) < int(limit[:-2]) * 2**30
    assert {"secretRef": {"name": "aot-s3"}} in triton["envFrom"]
    assert triton["envFrom"][0] == shared_triton["envFrom"][0]  # the repository's ConfigMap as before
    assert triton["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]


def test_repository_image_leaves_the_admin_key_out():
    """docker/Dockerfile.repository bakes a repository into the serving image at /mnt/aot/NAME, and the admin key
    is removed in a build stage whose layers the image does not keep."""
    text = (ROOT / "docker" / "Dockerfile.repository").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2
    assert "rm -f /repository/admin-key" in stages[0] and "COPY ${REPO}" in stages[0]
    assert stages[1].startswith("${BASE}") and "COPY --from=repository /repository /mnt/aot/${NAME}" in stages[1]
    assert "ARG BASE=aot-ptuning-triton:24.10" in text  # docker/Dockerfile's image, as docker-compose.yml tags it
