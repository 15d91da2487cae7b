"""Orchestration: compiled KFP IR, Argo templates and cron, Kubernetes manifests, submit errors.

Nothing here talks to a cluster; it checks what would be sent to one.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.cluster import ClusterSettings, Pool, Toleration, step_args, step_command

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"


# ---------------------------------------------------------------- KFP


@pytest.fixture(scope="module")
def kfp_dir(tmp_path_factory):
    from pipeline.kfp_pipelines import compile_pipelines

    out = tmp_path_factory.mktemp("kfp")
    compile_pipelines(str(out))
    return out


def _kfp_docs(path: Path) -> tuple[dict, dict]:
    spec, platform = list(yaml.safe_load_all(path.read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


@pytest.mark.parametrize("name,kind", [("batch_edit", "edit"), ("generate_dataset", "generate")])
def test_kfp_pipeline_structure(kfp_dir, name, kind):
    from kfp.components import load_component_from_file

    path = kfp_dir / f"{name}.yaml"
    loaded = load_component_from_file(str(path))  # the IR loads back as a component
    assert {"dataset", "output", "run_id", "num_shards", "model", "kv_store", "steps", "guidance",
            "gpu_image", "tools_image"} <= set(loaded.component_spec.inputs)

    spec, _ = _kfp_docs(path)
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {"shard", "shard-indices", "for-loop-1", "summary"}
    assert root["shard"]["inputs"]["parameters"]["kind"]["runtimeValue"]["constant"] == kind
    loop = root["for-loop-1"]
    assert loop["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--shard-indices-indices"
    assert loop["iteratorPolicy"]["parallelismLimit"] == ClusterSettings().max_parallel_shards
    assert set(loop["dependentTasks"]) == {"shard", "shard-indices"}
    assert "for-loop-1" in root["summary"]["dependentTasks"]  # summary waits for every shard

    body = spec["components"]["comp-for-loop-1"]["dag"]["tasks"]
    assert set(body) == {"ar", "dit"}
    assert body["dit"]["dependentTasks"] == ["ar"]
    for task in [body["ar"], body["dit"], root["shard"], root["summary"]]:
        assert task["retryPolicy"]["maxRetryCount"] == 3
        assert task["retryPolicy"]["backoffDuration"] == "30s"
        assert not task["cachingOptions"].get("enableCache", False)  # side effects: never cached


def test_kfp_executors_resources_env_and_command_lines(kfp_dir):
    spec, k8s = _kfp_docs(kfp_dir / "batch_edit.yaml")
    ex = spec["deploymentSpec"]["executors"]
    for step in ("ar", "dit"):
        c = ex[f"exec-{step}"]["container"]
        assert c["command"] == ["python", "-m", f"components.{step}"]
        assert c["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
        assert c["resources"]["accelerator"]["resourceCount"] == "1"
        assert "--kv-store" in c["args"] and "--shard" in c["args"]
        assert c["image"] == "{{$.inputs.parameters['pipelinechannel--gpu_image']}}"
        assert k8s[f"exec-{step}"]["nodeSelector"]["labels"] == {"ardit.io/pool": step}
        assert k8s[f"exec-{step}"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert ex["exec-dit"]["container"]["args"][-4:] == ["--steps", "{{$.inputs.parameters['steps']}}",
                                                        "--guidance", "{{$.inputs.parameters['guidance']}}"]
    assert "accelerator" not in ex["exec-shard"]["container"]["resources"]
    for step in ("shard", "ar", "dit", "summary"):
        secret = k8s[f"exec-{step}"]["secretAsEnv"][0]
        assert secret["secretName"] == "ardit-s3"
        assert {e["envVar"] for e in secret["keyToEnv"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        cm = k8s[f"exec-{step}"]["configMapAsEnv"][0]
        assert cm["configMapName"] == "ardit-endpoints"
        assert "ARDIT_KV_STORE" in {e["envVar"] for e in cm["keyToEnv"]}
    assert "secretAsEnv" not in k8s.get("exec-shard-indices", {})  # pure helper, no credentials


def test_kfp_pools_and_weights_follow_settings(tmp_path):
    from pipeline.kfp_pipelines import compile_pipelines

    s = ClusterSettings(ar_pool=Pool(cpu="4", memory="32Gi", gpus=2, node_selector={"pool": "h100"},
                                     tolerations=(Toleration(key="dedicated", operator="Equal", value="ar"),)),
                        weights_pvc="hunyuan-weights", max_parallel_shards=7)
    compile_pipelines(str(tmp_path), s)
    spec, k8s = _kfp_docs(tmp_path / "batch_edit.yaml")
    ar = spec["deploymentSpec"]["executors"]["exec-ar"]["container"]
    assert ar["resources"]["accelerator"]["resourceCount"] == "2"
    assert ar["args"][ar["args"].index("--weights") + 1] == "/weights"
    assert k8s["exec-ar"]["nodeSelector"]["labels"] == {"pool": "h100"}
    assert k8s["exec-ar"]["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ar",
                                              "effect": "NoSchedule"}]
    assert k8s["exec-ar"]["pvcMount"][0]["mountPath"] == "/weights"
    assert "pvcMount" not in k8s["exec-shard"]
    assert spec["root"]["dag"]["tasks"]["for-loop-1"]["iteratorPolicy"]["parallelismLimit"] == 7


def test_kfp_accuracy_sweep(kfp_dir):
    from pipeline.cluster import SWEEP_OUTPUT

    spec, k8s = _kfp_docs(kfp_dir / "accuracy_sweep.yaml")
    assert set(spec["root"]["dag"]["tasks"]) == {"sweep"}
    task = spec["root"]["dag"]["tasks"]["sweep"]
    assert "retryPolicy" not in task  # KFP would retry a failed accuracy gate (exit 1) as well
    c = spec["deploymentSpec"]["executors"]["exec-sweep"]["container"]
    assert c["command"] == ["python", "-m", "components.sweep"]
    assert c["args"][:2] == ["sweep", "/spec/spec.yaml"] and "--resume" in c["args"]
    assert c["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
    ex = k8s["exec-sweep"]
    assert ex["configMapAsVolume"][0]["mountPath"] == "/spec"
    assert ex["configMapAsVolume"][0]["configMapNameParameter"]["componentInputParameter"] == "spec_config_map"
    assert ex["pvcMount"][0]["mountPath"] == SWEEP_OUTPUT
    assert ex["pvcMount"][0]["constant"] == ClusterSettings().sweep_pvc


def test_shard_indices_helper_lists_every_shard(kfp_dir, tmp_path):
    """The inline helper that feeds ParallelFor really prints 0..N-1."""
    spec, _ = _kfp_docs(kfp_dir / "batch_edit.yaml")
    c = spec["deploymentSpec"]["executors"]["exec-shard-indices"]["container"]
    out = tmp_path / "indices"
    subprocess.run([sys.executable, *c["command"][1:], "3", str(out)], check=True)
    assert yaml.safe_load(out.read_text()) == [0, 1, 2]


# ---------------------------------------------------------------- Argo


def _roundtrip_equal(doc: dict, model_cls) -> None:
    """Type-check against Argo's schema (Hera's generated models): validating and dumping back must
    give the same document, so no field is unknown (dropped) or of the wrong type (changed)."""
    model = model_cls.model_validate(doc)
    assert model.model_dump(by_alias=True, exclude_none=True, mode="json") == doc


@pytest.fixture(scope="module")
def argo_docs():
    from pipeline.argo import render_all

    return {name: yaml.safe_load(text) for name, text in render_all().items()}


def _templates(spec: dict) -> dict[str, dict]:
    return {t["name"]: t for t in spec["templates"]}


@pytest.mark.parametrize("name,kind", [("ardit-batch-edit", "edit"), ("ardit-generate-dataset", "generate")])
def test_argo_workflow_template(argo_docs, name, kind):
    from hera.workflows import WorkflowTemplate
    from hera.workflows import models as m

    doc = argo_docs[f"{name}.yaml"]
    assert doc["kind"] == "WorkflowTemplate"
    _roundtrip_equal(doc, m.WorkflowTemplate)
    assert WorkflowTemplate.from_yaml(yaml.safe_dump(doc)).name == name

    spec = doc["spec"]
    t = _templates(spec)
    main = t["main"]
    assert main["parallelism"] == ClusterSettings().max_parallel_shards
    tasks = {x["name"]: x for x in main["dag"]["tasks"]}
    assert tasks["shard"]["template"] == "shard"
    assert {"name": "kind", "value": kind} in tasks["shard"]["arguments"]["parameters"]
    assert tasks["shards"]["template"] == "shard-pipeline" and tasks["shards"]["depends"] == "shard"
    assert tasks["shards"]["withSequence"] == {"count": "{{workflow.parameters.num_shards}}"}
    assert {"name": "shard", "value": "{{item}}"} in tasks["shards"]["arguments"]["parameters"]
    assert tasks["summary"]["depends"] == "shards"
    per_shard = {x["name"]: x for x in t["shard-pipeline"]["dag"]["tasks"]}
    assert per_shard["dit"]["depends"] == "ar"

    for step in ("shard", "ar", "dit", "summary"):
        tpl = t[step]
        assert tpl["container"]["command"] == step_command(step)
        # the container runs exactly the step program's command line, with inputs filled in
        values = {p["name"]: "{{inputs.parameters." + p["name"] + "}}" for p in tpl["inputs"]["parameters"]}
        assert tpl["container"]["args"] == step_args(step, **values)
        rs = tpl["retryStrategy"]
        assert rs["limit"] == 3 and rs["backoff"] == {"duration": "30s", "factor": 2, "maxDuration": "10m"}
        assert "exitCode" in rs["expression"]
        env = {e["name"]: e for e in tpl["container"]["env"]}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "ardit-s3"
        assert tpl["container"]["envFrom"] == [{"configMapRef": {"name": "ardit-endpoints", "optional": True}}]
    for step in ("ar", "dit"):
        res = t[step]["container"]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == "1" and res["requests"]["nvidia.com/gpu"] == "1"
        assert t[step]["nodeSelector"] == {"ardit.io/pool": step}
        assert t[step]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nvidia.com/gpu" not in t["shard"]["container"]["resources"].get("limits", {})

    assert spec["podGC"]["strategy"] == "OnPodSuccess"
    assert spec["serviceAccountName"] == "ardit-workflow"
    params = {p["name"]: p.get("value") for p in spec["arguments"]["parameters"]}
    assert params["dataset"] is None and params["output"] is None and params["run_id"] is None  # required
    assert params["kv_store"] == "$(ARDIT_KV_STORE)"


def test_argo_cron(argo_docs):
    from hera.workflows import models as m

    from components.data.runs import RunLayout
    from pipeline.argo import CRON_RUN_ID_KEEP

    doc = argo_docs["ardit-generate-dataset-cron.yaml"]
    assert doc["kind"] == "CronWorkflow"
    _roundtrip_equal(doc, m.CronWorkflow)
    spec = doc["spec"]
    s = ClusterSettings()
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["startingDeadlineSeconds"] == s.cron_starting_deadline_seconds
    assert spec["schedules"] == [s.cron_schedule] and spec["timezone"] == "UTC"
    wf = spec["workflowSpec"]
    assert "run_id" not in {p["name"] for p in wf["arguments"]["parameters"]}
    main = {x["name"]: x for x in _templates(wf)["main"]["dag"]["tasks"]}
    run_ids = {p["value"] for task in main.values() for p in task["arguments"]["parameters"] if p["name"] == "run_id"}
    assert len(run_ids) == 1
    run_id = run_ids.pop()
    assert "workflow.scheduledTime" in run_id  # same slot -> same run id -> a re-run resumes
    # What Argo's expression makes of a scheduled time must be a valid run id.
    expr = re.search(r"\{\{=.*?\}\}", run_id).group(0)
    resolved = run_id.replace(expr, re.sub(CRON_RUN_ID_KEEP, "", "2026-11-22T02:00:00+01:00"))
    assert resolved == "scheduled-20261122T0200000100"
    RunLayout(store=None, run_id=resolved)  # raises on an id that cannot become a path
    assert {"name": "kind", "value": "generate"} in main["shard"]["arguments"]["parameters"]


def test_argo_accuracy_sweep(argo_docs):
    from hera.workflows import models as m

    doc = argo_docs["ardit-accuracy-sweep.yaml"]
    _roundtrip_equal(doc, m.WorkflowTemplate)
    spec = doc["spec"]
    t = _templates(spec)
    assert [x["template"] for x in t["main"]["dag"]["tasks"]] == ["sweep"]
    sweep = t["sweep"]
    assert sweep["container"]["command"] == ["python", "-m", "components.sweep"]
    assert "not in [1, 2]" in sweep["retryStrategy"]["expression"]  # a failed gate is a result, not a fault
    assert sweep["container"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    mounts = {v["name"]: v["mountPath"] for v in sweep["container"]["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts == {"sweep-spec": "/spec", "sweeps": "/sweeps"}
    assert volumes["sweep-spec"]["configMap"]["name"] == "{{workflow.parameters.spec_config_map}}"
    assert volumes["sweeps"]["persistentVolumeClaim"]["claimName"] == "ardit-sweeps"
    pvcs = [d for _, d in _manifest_docs("objects") if d["kind"] == "PersistentVolumeClaim"]
    assert [p["metadata"]["name"] for p in pvcs] == ["ardit-sweeps"]


def test_committed_argo_renders_equal_generated():
    from pipeline.argo import render_all

    rendered = render_all()
    committed = {p.name: p.read_text() for p in (MANIFESTS / "base" / "argo").glob("*.yaml")}
    assert committed == rendered, "run: ardit compile --engine argo --out manifests/base"


def test_compile_command_writes_both_engines(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    result = CliRunner().invoke(app, ["compile", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "kfp").iterdir()) == ["accuracy_sweep.yaml", "batch_edit.yaml",
                                                                   "generate_dataset.yaml"]
    assert sorted(p.name for p in (tmp_path / "argo").iterdir()) == sorted(
        p.name for p in (MANIFESTS / "base" / "argo").iterdir())


# ---------------------------------------------------------------- manifests


def _kustomize_files() -> tuple[set[Path], set[Path]]:
    """(resource files, patch files) named by the kustomizations, examples excluded."""
    resources, patches = set(), set()
    for kfile in MANIFESTS.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        resources |= {(kfile.parent / r).resolve() for r in k.get("resources", []) if r.endswith(".yaml")}
        patches |= {(kfile.parent / p["path"]).resolve() for p in k.get("patches", [])}
    return resources, patches


def _manifest_docs(kind: str = "all") -> list[tuple[Path, dict]]:
    """Every object in manifests/ (Argo renders excluded: they are checked against Argo's models)."""
    _, patches = _kustomize_files()
    docs = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.parent.name == "argo":
            continue
        if (kind == "patches") != (path.resolve() in patches) and kind != "all":
            continue
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _merge(base, patch):
    """Strategic-merge enough for our patches: maps merge, lists of named maps merge by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {k: _merge(base[k], v) if k in base else v for k, v in patch.items()} | \
            {k: v for k, v in base.items() if k not in patch}
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x
                                                                  for x in base + patch):
        names = [x["name"] for x in base] + [x["name"] for x in patch if x["name"] not in {b["name"] for b in base}]
        by_base, by_patch = {x["name"]: x for x in base}, {x["name"]: x for x in patch}
        return [_merge(by_base[n], by_patch[n]) if n in by_base and n in by_patch else by_base.get(n, by_patch.get(n))
                for n in names]
    return patch


def _k8s_class(doc: dict) -> str:
    version = doc["apiVersion"].split("/")[-1]
    return f"{version[0].upper()}{version[1:]}{doc['kind']}"  # apps/v1 Deployment -> V1Deployment


def _check_k8s(api, doc: dict, where: str) -> None:
    model = api._ApiClient__deserialize(doc, _k8s_class(doc))  # raises on missing required fields
    # nothing unknown or mistyped: the model serialises back to the same document
    assert api.sanitize_for_serialization(model) == doc, where


def test_every_manifest_parses_into_kubernetes_models():
    """kustomize/kubectl are not available here: each object (and each patch applied to its base
    object) is loaded into the kubernetes client's models instead."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    objects = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifest_docs("objects")}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "StatefulSet",
            "ConfigMap", "Secret"} <= {kind for kind, _ in objects}
    for path, doc in _manifest_docs("objects"):
        _check_k8s(api, doc, f"{path.relative_to(REPO)} {doc['kind']}/{doc['metadata']['name']}")
    for path, patch in _manifest_docs("patches"):
        base = objects[(patch["kind"], patch["metadata"]["name"])]
        _check_k8s(api, _merge(base, patch), f"{path.relative_to(REPO)} applied to its base")


def test_kustomizations_reference_existing_files_and_patch_real_objects():
    resources, patches = _kustomize_files()
    assert all(p.exists() for p in resources | patches), [str(p) for p in resources | patches if not p.exists()]
    objects = {(d["kind"], d["metadata"]["name"]) for _, d in _manifest_docs("objects")}
    for path in patches:
        p = yaml.safe_load(path.read_text())
        assert (p["kind"], p["metadata"]["name"]) in objects, f"{path} patches nothing"
    # every object file is either used by a kustomization or is the Secret example
    for path, _ in _manifest_docs("objects"):
        assert path.resolve() in resources or path.name.endswith(".example.yaml"), path


def test_rbac_is_least_privilege_and_matches_templates(argo_docs):
    rbac = {d["kind"]: d for d in yaml.safe_load_all((MANIFESTS / "base" / "rbac.yaml").read_text())}
    rules = {(g, r, v) for rule in rbac["Role"]["rules"] for g in rule["apiGroups"] for r in rule["resources"]
             for v in rule["verbs"]}
    assert rules == {("argoproj.io", "workflowtaskresults", "create"), ("argoproj.io", "workflowtaskresults", "patch"),
                     ("", "pods/log", "get")}
    sa = rbac["ServiceAccount"]["metadata"]["name"]
    for doc in argo_docs.values():
        spec = doc["spec"].get("workflowSpec", doc["spec"])
        assert spec["serviceAccountName"] == sa


def test_endpoints_configmap_has_every_key_the_steps_read():
    from pipeline.cluster import ENDPOINT_KEYS

    cm = yaml.safe_load((MANIFESTS / "base" / "endpoints.yaml").read_text())
    dev = _merge(cm, yaml.safe_load((MANIFESTS / "overlays" / "dev" / "endpoints-patch.yaml").read_text()))
    assert set(ENDPOINT_KEYS) == set(dev["data"])
    assert all(dev["data"].values())  # an empty AWS_ENDPOINT_URL would send boto3 nowhere
    assert cm["data"]["ARDIT_KV_STORE"].startswith("mooncake://mooncake-master.ardit:50051?")


def test_segment_holders_request_their_segment_size():
    objects = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifest_docs("objects")}
    docs = [d for d in objects.values() if d["kind"] == "StatefulSet"]
    docs += [_merge(objects[(p["kind"], p["metadata"]["name"])], p) for _, p in _manifest_docs("patches")
             if p["kind"] == "StatefulSet"]
    assert len(docs) == 2
    for doc in docs:
        c = doc["spec"]["template"]["spec"]["containers"][0]
        size = int({e["name"]: e.get("value") for e in c["env"]}["SEGMENT_SIZE"])  # bytes
        assert c["resources"]["requests"]["memory"] == f"{size >> 30}Gi" and size % (1 << 30) == 0


# ---------------------------------------------------------------- submit


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.mark.parametrize("engine,what", [("argo", "Argo server"), ("kfp", "KFP API")])
def test_submit_to_unreachable_endpoint_fails_clearly(engine, what):
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    host = f"http://127.0.0.1:{_closed_port()}"
    result = CliRunner().invoke(app, ["submit", "--engine", engine, "--host", host,
                                      "-p", "dataset=s3://ardit/in.parquet", "-p", "output=s3://ardit/out"])
    assert result.exit_code != 0
    assert f"cannot reach the {what} at {host}" in str(result.exception) + result.output
    assert "Connection refused" in str(result.exception) + result.output


def test_submit_rejects_bad_parameters():
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    r = CliRunner().invoke(app, ["submit", "--engine", "kfp", "--host", "http://127.0.0.1:1", "-p", "dataset=x"])
    assert r.exit_code == 2 and "output" in r.output
    r = CliRunner().invoke(app, ["submit", "--engine", "kfp", "--host", "http://127.0.0.1:1", "-p", "dataset=x",
                                 "-p", "output=y", "-p", "stepz=3"])
    assert r.exit_code == 2 and "stepz" in r.output


# ---------------------------------------------------------------- step command lines


def test_shard_and_summary_accept_the_wired_command_lines(tmp_path):
    """The argv the workflows run is accepted by the real step programs."""
    from components.data.sample import write_sample_edit_dataset

    dataset = write_sample_edit_dataset(str(tmp_path / "in.parquet"), n=3, size=32)
    out = str(tmp_path / "out")
    for step, values in [("shard", {"dataset": dataset, "output": out, "run_id": "r1", "num_shards": 2,
                                     "kind": "edit"}),
                         ("summary", {"output": out, "run_id": "r1"})]:
        argv = [sys.executable, *step_command(step)[1:], *map(str, step_args(step, **values))]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "r1" / "summary.json").exists()


def test_sweep_accepts_the_wired_command_line(tmp_path):
    spec = REPO / "examples" / "sweeps" / "tiny.yaml"
    if not spec.exists():
        pytest.skip("no example sweep spec")
    argv = step_args("sweep", spec=str(spec), output=str(tmp_path), sweep_id="s1")
    done = subprocess.run([sys.executable, *step_command("sweep")[1:], *argv, "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    assert "configs" in done.stdout


def test_cluster_settings_from_yaml(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("gpu_image: reg/x:1\nar_pool: {cpu: '2', memory: 8Gi, gpus: 1, node_selector: {a: b},\n"
                    "  tolerations: [{key: k, effect: NoExecute}]}\n")
    s = ClusterSettings.from_yaml(path)
    assert s.gpu_image == "reg/x:1" and s.ar_pool.tolerations == (Toleration(key="k", effect="NoExecute"),)
    path.write_text("gpu_imgae: typo\n")
    with pytest.raises(ValueError, match="gpu_imgae"):
        ClusterSettings.from_yaml(path)
