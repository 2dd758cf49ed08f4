"""Offline checks of everything under cluster/: launcher YAMLs, KubeRay manifests, runtime_env.

1. Ray cluster-launcher YAMLs are validated the way `ray up` validates them before it touches a
   cloud. `ray up` -> commands.create_or_update_cluster -> _bootstrap_config(config), which runs
     prepare_config(config)   offline: merges ray/autoscaler/<provider>/defaults.yaml under the
                              file (top-level keys), merges setup commands, checks docker, fills
                              per-node-type min/max_workers
     validate_config(config)  offline: jsonschema against ray/autoscaler/ray-schema.json, then
                              head_node_type / sum(min_workers) <= max_workers checks
   and only then the provider's bootstrap_config (AWS: IAM role, key pair, subnets, security
   groups through boto3; GCP: service account, keys, TPU API through googleapiclient) and
   fillout_available_node_types_resources (AWS: describe-instance-types). Those need cloud
   credentials and network, so the tests stop after validate_config -- the same two functions,
   not a re-implementation -- and run them with sockets disabled to prove they stay offline.
   Deliberately broken copies must fail there.
2. KubeRay manifests are validated against the CRDs in ../shared/kuberay (strict: unknown keys
   are errors, because the API server would silently prune them).
3. The working_dir that `ray job submit --working-dir . --runtime-env cluster/runtime_env.yaml`
   uploads is built with Ray's own packaging code and must stay under the job server's 100 MiB
   limit, without .git.
"""

from __future__ import annotations

import copy
import functools
import os
import socket
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
KUBERAY_CRDS = Path(__file__).resolve().parents[2] / "shared" / "kuberay"
LAUNCHER_YAMLS = sorted(p for p in CLUSTER.glob("*.yaml") if p.name != "runtime_env.yaml")
KUBERAY_YAMLS = sorted((CLUSTER / "kuberay").glob("*.yaml"))
RUNTIME_ENV = CLUSTER / "runtime_env.yaml"
PRIVATE_PORTS = {8265, 6379, 10001, 5000}  # dashboard, GCS, Ray client, MLflow


def _load(path: Path):
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection (boto3, googleapiclient, requests) fails loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during offline validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def ray_up_validate(cfg: dict) -> dict:
    """What `ray up` checks before it calls the cloud (see module docstring)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


# --------------------------------------------------------------------------- launcher YAMLs


def test_expected_launcher_configs_exist():
    names = {p.name for p in LAUNCHER_YAMLS}
    assert {"aws-gpu.yaml", "gcp-tpu-v4.yaml"} <= names, names


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_launcher_config_validates_like_ray_up(path, no_network):
    cfg = _load(path)
    prepared = ray_up_validate(cfg)
    # Our commands, not the defaults' (which install a Ray nightly wheel): every top-level key
    # that prepare_config would otherwise take from defaults.yaml is set in the file.
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands", "file_mounts"):
        assert key in cfg, f"{path.name}: {key} falls back to Ray's defaults.yaml"
    assert any("scripts/install.sh" in c for c in prepared["head_setup_commands"])
    assert any("scripts/install.sh" in c for c in prepared["worker_setup_commands"])
    # Autoscaling: some worker type can grow beyond its minimum.
    types = prepared["available_node_types"]
    workers = {k: v for k, v in types.items() if k != prepared["head_node_type"]}
    assert workers and any(v["max_workers"] > v["min_workers"] for v in workers.values())
    assert prepared["max_workers"] >= sum(v["min_workers"] for v in workers.values())


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_launcher_config_keeps_ports_private_and_uses_token_auth(path):
    cfg = _load(path)
    head_cmds = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmds and "--dashboard-host=0.0.0.0" not in head_cmds
    for cmds in (cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]):
        assert "RAY_AUTH_MODE=token" in " ".join(cmds)
    assert any(remote.endswith("/.ray/auth_token") for remote in cfg["file_mounts"])
    # Nothing opens the private ports to the internet (AWS: extra security-group rules).
    for perm in cfg["provider"].get("security_group", {}).get("IpPermissions", []):
        ports = set(range(perm.get("FromPort", 0), perm.get("ToPort", 65535) + 1))
        world = any(r.get("CidrIp") == "0.0.0.0/0" for r in perm.get("IpRanges", []))
        assert not (world and ports & PRIVATE_PORTS), perm


BROKEN = {
    # name: (mutation, exception types `ray up` raises for it)
    "unknown_top_level_key": (lambda c: c.update(max_worker=3), (jsonschema.ValidationError,)),
    "max_workers_wrong_type": (lambda c: c.update(max_workers="six"), (jsonschema.ValidationError,)),
    "missing_provider": (lambda c: c.pop("provider"), (KeyError, jsonschema.ValidationError)),
    "unknown_node_type_key": (
        lambda c: c["available_node_types"][c["head_node_type"]].update(min_worker=0),
        (jsonschema.ValidationError,)),
    "fractional_gpu_resource": (
        lambda c: next(v for k, v in c["available_node_types"].items()
                       if k != c["head_node_type"])["resources"].update(GPU=0.5),
        (jsonschema.ValidationError,)),
    "head_type_not_defined": (lambda c: c.update(head_node_type="nope"), (ValueError,)),
    "min_workers_exceed_max": (
        lambda c: next(v for k, v in c["available_node_types"].items()
                       if k != c["head_node_type"]).update(min_workers=c["max_workers"] + 1),
        (ValueError,)),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_broken_launcher_config_fails(path, broken, no_network):
    cfg = _load(path)
    mutate, errors = BROKEN[broken]
    mutate(cfg)
    with pytest.raises(errors):
        ray_up_validate(cfg)


def test_aws_config_has_a10g_and_h100_workers():
    cfg = _load(CLUSTER / "aws-gpu.yaml")
    types = {v["node_config"]["InstanceType"]: v for v in cfg["available_node_types"].values()}
    assert any(t.startswith("g5.") for t in types), types.keys()
    assert any(t.startswith(("p5.", "p4d.", "p4de.")) for t in types), types.keys()
    for t, v in types.items():
        if t.startswith(("g5.", "p5.", "p4d.", "p4de.")):
            assert v["resources"].get("GPU", 0) >= 1 and v["max_workers"] > v["min_workers"]


def test_gcp_tpu_head_resource_matches_ray():
    """The TPU node type declares the resources Ray's GCP provider fills in, and the pod type
    equals what JaxTrainer(topology="2x2x2", accelerator_type="TPU-V4") asks for."""
    from ray._private.accelerators import tpu

    cfg = _load(CLUSTER / "gcp-tpu-v4.yaml")
    tpu_types = {k: v for k, v in cfg["available_node_types"].items()
                 if "acceleratorType" in v["node_config"]}
    assert tpu_types, "no TPU node type"
    try:  # the real thing, where the GCP client libraries are installed
        from ray.autoscaler._private.gcp.node_provider import GCPNodeProvider
        filled = GCPNodeProvider.fillout_available_node_types_resources(
            copy.deepcopy(cfg))["available_node_types"]
    except ImportError:  # googleapiclient absent: mirror its two lines (node_provider.py)
        filled = copy.deepcopy(cfg["available_node_types"])
        for v in filled.values():
            if "acceleratorType" in v["node_config"]:
                v["resources"].update({f"TPU-{v['node_config']['acceleratorType']}-head": 1})
    for name, v in tpu_types.items():
        acc = v["node_config"]["acceleratorType"]
        assert tpu.TPUAcceleratorManager.is_valid_tpu_accelerator_type(acc)
        assert v["resources"] == filled[name]["resources"], "declared resources differ from Ray's"
        assert v["resources"]["TPU"] == tpu.get_num_tpu_visible_chips_per_host(acc)
        chips = int(acc.split("-")[1]) // tpu.get_tpu_cores_per_chip(acc)
        assert chips // v["resources"]["TPU"] >= 2, "expected a multi-host pod slice"
    assert "TPU-v4-16-head" in tpu_types["tpu_v4_16"]["resources"]
    assert tpu.infer_tpu_pod_type_from_topology("2x2x2", "TPU-V4") == "v4-16"


def test_tpu_job_script_matches_the_slice_and_the_config():
    """examples/train_hackmatrix_ppo_tpu.sh asks for the slice cluster/gcp-tpu-v4.yaml provides
    (pod type, hosts) and sets only keys the hackmatrix_ppo config has."""
    import re

    from ray._private.accelerators import tpu
    from ray.util.tpu import get_tpu_worker_resources

    from raysys.config import apply_overrides
    from raysys.workloads.hackmatrix_ppo.workload import default

    script = (REPO / "examples" / "train_hackmatrix_ppo_tpu.sh").read_text()
    sets = dict(re.findall(r'--set ([\w.]+)="\$\{\w+:-([^}]*)\}"', script))
    sets |= dict(re.findall(r"--set ([\w.]+)=(true|false)\b", script))
    cfg = apply_overrides(default(), sets)
    cfg.launch.validate()
    assert cfg.launch.use_tpu and cfg.launch.workers == 2, sets
    pod = tpu.infer_tpu_pod_type_from_topology(cfg.launch.topology, cfg.launch.accelerator_type)
    accelerators = {v["node_config"].get("acceleratorType") for v in _load(CLUSTER / "gcp-tpu-v4.yaml")["available_node_types"].values()}
    assert pod in accelerators, (pod, accelerators)
    hosts, per_host = get_tpu_worker_resources(topology=cfg.launch.topology, accelerator_type=cfg.launch.accelerator_type)
    assert hosts == cfg.launch.workers and cfg.train.num_envs % (hosts * per_host["TPU"]) == 0


# --------------------------------------------------------------------------- KubeRay manifests


def _crd_schemas(strict: bool) -> dict:
    if not KUBERAY_CRDS.is_dir():
        pytest.skip(f"../shared/kuberay not present: no KubeRay CRDs to validate against ({KUBERAY_CRDS})")
    return _crd_schemas_cached(strict)


@functools.lru_cache(maxsize=None)
def _load_crds() -> tuple:
    # The CRDs are 1-2 MB each: libyaml's loader parses them ~8x faster than the pure-Python one.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(yaml.load(f.read_text(), Loader=loader) for f in sorted(KUBERAY_CRDS.glob("*.yaml")))


@functools.lru_cache(maxsize=None)
def _crd_schemas_cached(strict: bool) -> dict:
    out = {}
    for crd in _load_crds():
        if crd.get("kind") != "CustomResourceDefinition":
            continue
        for ver in crd["spec"]["versions"]:
            schema = copy.deepcopy(ver["schema"]["openAPIV3Schema"])
            if strict:
                _forbid_unknown(schema)
            out[(f"{crd['spec']['group']}/{ver['name']}", crd["spec"]["names"]["kind"])] = schema
    return out


def _forbid_unknown(node):
    """additionalProperties: false wherever an object lists its properties and does not opt
    out with x-kubernetes-preserve-unknown-fields (../shared/kuberay/README.md)."""
    if isinstance(node, dict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for v in node.values():
            _forbid_unknown(v)
    elif isinstance(node, list):
        for v in node:
            _forbid_unknown(v)


def _validate_manifest(doc: dict, schemas: dict):
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in schemas, f"no CRD for {key}"
    jsonschema.Draft7Validator(schemas[key]).validate(doc)


def _kuberay_docs():
    return [(p, i, d) for p in KUBERAY_YAMLS
            for i, d in enumerate(yaml.safe_load_all(p.read_text())) if d]


def _cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def test_expected_kuberay_manifests_exist():
    assert {"raycluster.yaml", "rayjob-sweep.yaml"} <= {p.name for p in KUBERAY_YAMLS}


@pytest.mark.parametrize("path", KUBERAY_YAMLS, ids=lambda p: p.name)
def test_kuberay_manifest_validates_strictly(path):
    schemas = _crd_schemas(strict=True)
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    ray_docs = [d for d in docs if str(d.get("apiVersion", "")).startswith("ray.io/")]
    assert ray_docs, f"{path.name} has no ray.io resource"
    for doc in ray_docs:
        _validate_manifest(doc, schemas)
    for doc in docs:  # the only non-Ray object allowed: a PVC for the MLflow store
        if doc not in ray_docs:
            assert (doc["apiVersion"], doc["kind"]) == ("v1", "PersistentVolumeClaim"), doc["kind"]


def test_kuberay_dashboard_stays_private():
    for path, _, doc in _kuberay_docs():
        assert doc.get("kind") != "Service" or doc["spec"].get("type", "ClusterIP") == "ClusterIP"
        if doc["kind"] in ("RayCluster", "RayJob"):
            spec = _cluster_spec(doc)
            head = spec["headGroupSpec"]
            assert head.get("serviceType") == "ClusterIP", path.name
            assert not head.get("enableIngress"), path.name
            assert head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
            assert spec.get("authOptions", {}).get("mode") == "token", path.name


def test_kuberay_groups_and_sweep():
    docs = {d["kind"]: d for _, _, d in _kuberay_docs()}
    rc = docs["RayCluster"]["spec"]
    groups = {g["groupName"]: g for g in rc["workerGroupSpecs"]}

    def limits(g):
        return g["template"]["spec"]["containers"][0]["resources"]["limits"]

    gpu = [g for g in groups.values() if "nvidia.com/gpu" in limits(g)]
    tpu = [g for g in groups.values() if "google.com/tpu" in limits(g)]
    assert gpu and tpu
    for g in gpu + tpu:
        assert g["maxReplicas"] > g["minReplicas"]
    for g in tpu:
        sel = g["template"]["spec"]["nodeSelector"]
        assert sel["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-v4")
        chips = 1
        for n in sel["cloud.google.com/gke-tpu-topology"].split("x"):
            chips *= int(n)
        assert g["numOfHosts"] * int(limits(g)["google.com/tpu"]) == chips
    entry = docs["RayJob"]["spec"]["entrypoint"]
    assert "python -m raysys.tune --space tune_spaces/deep_gpcm.yaml --num-samples 6" in entry


BROKEN_K8S = {
    # name: (mutation on the RayCluster spec, caught without the strict pass?)
    "misspelled_rayStartParams": (lambda s: s["workerGroupSpecs"][0].update(
        rayStartParam=s["workerGroupSpecs"][0].pop("rayStartParams")), False),
    "misspelled_serviceType": (lambda s: s["headGroupSpec"].update(
        servicetype=s["headGroupSpec"].pop("serviceType")), False),
    "misspelled_container_resources": (lambda s: s["headGroupSpec"]["template"]["spec"]["containers"][0].update(
        resource=s["headGroupSpec"]["template"]["spec"]["containers"][0].pop("resources")), False),
    "misspelled_numOfHosts": (lambda s: s["workerGroupSpecs"][-1].update(numOfHost=2), False),
    "replicas_wrong_type": (lambda s: s["workerGroupSpecs"][0].update(maxReplicas="four"), True),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_K8S))
@pytest.mark.parametrize("path", KUBERAY_YAMLS, ids=lambda p: p.name)
def test_broken_kuberay_manifest_fails(path, broken):
    strict, lenient = _crd_schemas(strict=True), _crd_schemas(strict=False)
    mutate, lenient_catches = BROKEN_K8S[broken]
    doc = next(d for d in yaml.safe_load_all(path.read_text())
               if d and d.get("kind") in ("RayCluster", "RayJob"))
    bad = copy.deepcopy(doc)
    mutate(_cluster_spec(bad))
    with pytest.raises(jsonschema.ValidationError):
        _validate_manifest(bad, strict)
    if not lenient_catches:  # the plain CRD schema (what the API server checks) lets it through
        _validate_manifest(bad, lenient)


# --------------------------------------------------------------------------- runtime_env / upload


KNOWN_RUNTIME_ENV_KEYS = {"working_dir", "excludes", "env_vars", "py_modules", "pip", "uv",
                          "conda", "container", "image_uri", "config", "nsight", "py_executable"}


def test_runtime_env_is_valid_for_ray():
    from ray.runtime_env import RuntimeEnv

    env = _load(RUNTIME_ENV)
    assert set(env) <= KNOWN_RUNTIME_ENV_KEYS, set(env) - KNOWN_RUNTIME_ENV_KEYS
    RuntimeEnv(**env)  # type checks (env_vars: Dict[str, str], excludes: List[str], ...)
    assert "RAYSYS_TRACKING_URI" in env["env_vars"]
    must = {".git/", "mlruns/", "mlflow.db", "raysys_runs/", "raysys_data/", ".venv/", "venv/"}
    assert must <= set(env["excludes"])
    rayignore = [ln.strip() for ln in (REPO / ".rayignore").read_text().splitlines()
                 if ln.strip() and not ln.startswith("#")]
    assert set(rayignore) == set(env["excludes"]), "keep .rayignore and runtime_env excludes in sync"


def _ray_upload_plan(working_dir: Path):
    """The runtime_env and excludes `ray job submit --working-dir <dir> --runtime-env
    cluster/runtime_env.yaml` would use: Ray's CLI parser, then Ray's upload_working_dir_if_needed
    with an upload_fn that records instead of uploading (JobSubmissionClient passes its own
    upload_fn the same way, dashboard_sdk._upload_working_dir_if_needed)."""
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args

    runtime_env = parse_runtime_env_args(runtime_env=str(RUNTIME_ENV), working_dir=str(working_dir))
    seen = {}

    def record(path, excludes, is_file=False):
        seen.update(path=path, excludes=list(excludes), is_file=is_file)

    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    upload_working_dir_if_needed(copy.deepcopy(runtime_env), include_gitignore=include_gitignore,
                                 upload_fn=record)
    assert seen and not seen["is_file"]
    return seen["path"], seen["excludes"], include_gitignore


def _ray_file_list(root: Path, excludes, include_gitignore):
    """Files Ray would pack: its own traversal and matchers (packaging._zip_files uses exactly
    _dir_travel + _get_excludes + .gitignore/.rayignore per folder)."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    files = []
    _dir_travel(root, [_get_excludes(root, list(excludes))],
                lambda p: files.append(p) if p.is_file() else None,
                include_gitignore=include_gitignore)
    return files


def test_working_dir_upload_under_limit_and_without_git(tmp_path):
    from ray._private.ray_constants import DASHBOARD_CLIENT_MAX_SIZE
    from ray._private.runtime_env.packaging import create_package

    assert DASHBOARD_CLIENT_MAX_SIZE == 100 * 1024**2  # the job server's upload cap
    path, excludes, include_gitignore = _ray_upload_plan(REPO)
    assert Path(path).resolve() == REPO

    files = _ray_file_list(REPO, excludes, include_gitignore)
    total = sum(f.stat().st_size for f in files)
    biggest = sorted(files, key=lambda f: f.stat().st_size, reverse=True)[:5]
    # Fail fast (before zipping gigabytes) with the culprits named.
    assert total < DASHBOARD_CLIENT_MAX_SIZE, [(str(f.relative_to(REPO)), f.stat().st_size) for f in biggest]

    pkg = tmp_path / "working_dir.zip"
    create_package(str(REPO), pkg, include_gitignore=include_gitignore, excludes=excludes)
    size = pkg.stat().st_size
    assert size < DASHBOARD_CLIENT_MAX_SIZE, f"{size / 2**20:.1f} MiB"
    names = zipfile.ZipFile(pkg).namelist()
    assert names, "empty package"
    assert not [n for n in names if n == ".git" or n.startswith(".git/")]
    assert not [n for n in names if n.split("/")[0] in {"mlruns", "raysys_runs", "raysys_data", ".venv"}]
    assert "raysys/__init__.py" in names


def test_git_excluded_even_without_ray_default_excludes(monkeypatch, tmp_path):
    """Ray 2.60 also excludes .git by default, but that default can be switched off
    (RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES=''); our .rayignore/excludes must suffice."""
    monkeypatch.setenv("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", "")
    # Negative control: a folder with a .git and no ignore files does ship .git.
    bare = tmp_path / "bare"
    (bare / ".git").mkdir(parents=True)
    (bare / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (bare / "main.py").write_text("print(1)\n")
    assert any(".git" in f.parts for f in _ray_file_list(bare, [], True))
    # The repo, with only our ignore files and runtime_env excludes.
    path, excludes, include_gitignore = _ray_upload_plan(REPO)
    assert ".git" not in excludes or ".git/" in excludes  # only ours remain
    files = _ray_file_list(REPO, excludes, include_gitignore)
    assert files and not [f for f in files if ".git" in f.relative_to(REPO).parts]
    # runtime_env excludes alone (no .gitignore/.rayignore in the folder) keep .git out too.
    only_excludes = _ray_file_list(bare, _load(RUNTIME_ENV)["excludes"], True)
    assert [f.name for f in only_excludes] == ["main.py"]


def test_an_installed_wheel_ships_every_module_of_raysys():
    """A runtime env's `pip` (docs/your-workload.md) and any non-editable install take the packages
    pyproject's find rule finds: a folder of modules without __init__.py (hackmatrix_ppo had none) is left
    out of the wheel, and its workload is missing on the cluster."""
    from setuptools import find_packages

    root = Path(__file__).resolve().parents[1]
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(str(root), include=include))
    folders = {".".join(p.parent.relative_to(root).parts) for p in (root / "raysys").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders <= shipped, sorted(folders - shipped)
