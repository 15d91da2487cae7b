"""Orchestration: compiled KFP IR, Argo templates and cron, submit / schedule, step command lines.

Nothing here talks to a cluster; it checks what would be sent to one. Manifests: test_orchestration_manifests.py;
images: test_orchestration_images.py; the step launcher: test_orchestration_launch.py.
"""

from __future__ import annotations

import inspect
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.cluster import (
    RUN_PARAMETERS,
    ClusterSettings,
    Pool,
    RetryPolicy,
    Toleration,
    check_model_and_weights,
    step_args,
    step_command,
)

from pipeline.argo import render_all  # hera is imported inside its functions

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
IMAGES = {"ardit-gpu": "reg.example/ml/ardit-gpu:0.1.0-abc", "ardit-tools": "reg.example/ml/ardit-tools:0.1.0-abc"}


# ---------------------------------------------------------------- KFP


@pytest.fixture(scope="module")
def kfp_dir(tmp_path_factory):
    from pipeline.kfp_pipelines import compile_pipelines

    out = tmp_path_factory.mktemp("kfp")
    compile_pipelines(str(out), ClusterSettings().with_images(IMAGES))
    return out


def _kfp_docs(path: Path) -> tuple[dict, dict]:
    spec, platform = list(yaml.safe_load_all(path.read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _dag_tasks(spec: dict, component: str | None = None) -> dict:
    return (spec["root"] if component is None else spec["components"][component])["dag"]["tasks"]


def _branches(spec: dict) -> dict[str, dict]:
    """{"no-weights-pvc": dag tasks, "weights-pvc": dag tasks} of the If / Else on weights_pvc."""
    out = {}
    for comp in spec["components"].values():
        for name, task in comp.get("dag", {}).get("tasks", {}).items():
            if task["taskInfo"]["name"] in ("no-weights-pvc", "weights-pvc"):
                out[task["taskInfo"]["name"]] = _dag_tasks(spec, task["componentRef"]["name"]) | {
                    "_condition": task["triggerPolicy"]["condition"]}
    return out


@pytest.mark.parametrize("name,kind", [("batch_edit", "edit"), ("generate_dataset", "generate")])
def test_kfp_pipeline_structure(kfp_dir, name, kind):
    from kfp.components import load_component_from_file

    path = kfp_dir / f"{name}.yaml"
    loaded = load_component_from_file(str(path))  # the IR loads back as a component
    assert set(loaded.component_spec.inputs) == set(RUN_PARAMETERS)
    for param, default in RUN_PARAMETERS.items():
        declared = loaded.component_spec.inputs[param].default
        if isinstance(declared, float):  # the IR loader reads integer defaults back as floats
            declared = int(declared)
        assert (declared is None) == (default is None) and (default is None or str(declared) == default), param

    spec, k8s = _kfp_docs(path)
    branches = _branches(spec)
    assert set(branches) == {"no-weights-pvc", "weights-pvc"}
    assert "== ''" in branches["no-weights-pvc"]["_condition"] and "weights_pvc" in branches["weights-pvc"]["_condition"]
    for branch, tasks in branches.items():
        loops = [t for t in tasks if t.startswith("for-loop")]
        assert len(loops) == 1
        loop = tasks[loops[0]]
        shard = next(t for n, t in tasks.items() if n.startswith("shard") and "indices" not in n)
        assert shard["inputs"]["parameters"]["kind"]["runtimeValue"]["constant"] == kind
        assert loop["iteratorPolicy"]["parallelismLimit"] == ClusterSettings().max_parallel_shards
        summary = next(t for n, t in tasks.items() if n.startswith("summary"))
        assert loops[0] in summary["dependentTasks"]  # summary waits for every shard
        body = _dag_tasks(spec, loop["componentRef"]["name"])
        ar, dit = (next(t for n, t in body.items() if n.startswith(step)) for step in ("ar", "dit"))
        assert dit["dependentTasks"] == [next(n for n in body if n.startswith("ar"))]
        for task in [ar, dit, shard, summary]:
            # KFP retries every failure, exit code 2 included: the launcher retries instead
            assert "retryPolicy" not in task
            assert not task["cachingOptions"].get("enableCache", False)  # side effects: never cached
            mounts = k8s[task["componentRef"]["name"].replace("comp-", "exec-")].get("pvcMount", [])
            if task is summary:
                assert mounts == []
            else:  # only the weights branch mounts the PVC, on the steps that read the model
                assert [m["mountPath"] for m in mounts] == (["/weights"] if branch == "weights-pvc" else [])


def _launcher_options(command: list[str]) -> dict[str, str]:
    """--name value pairs of the launcher part (before "--") of a step command."""
    head = command[3:command.index("--")]
    return dict(zip(head[::2], head[1::2], strict=True))


def test_kfp_executors(kfp_dir):
    spec, k8s = _kfp_docs(kfp_dir / "batch_edit.yaml")
    s = ClusterSettings()
    for name, ex in spec["deploymentSpec"]["executors"].items():
        c = ex["container"]
        step = re.sub(r"^exec-|-\d+$", "", name)
        platform = k8s[name]
        assert platform["securityContext"] == {"runAsUser": "10001", "runAsGroup": "10001", "runAsNonRoot": True}
        assert int(platform["activeDeadlineSeconds"]) > 0
        if step in ("shard-indices", "gpus-per-model"):
            assert c["image"] == IMAGES["ardit-tools"] and "secretAsEnv" not in platform  # pure helper
            continue
        assert c["command"][:3] == ["python", "-m", "pipeline.launch"]
        assert c["command"][-3:] == ["python", "-m", f"components.{step}"]
        opts = _launcher_options(c["command"])
        policy = s.retry_policy(step)
        assert opts["--retries"] == "3" and opts["--no-retry-exit-codes"] == "2" == ",".join(map(str, policy.never))
        assert int(opts["--attempt-timeout"]) == s.deadline(step)
        # the pod deadline covers every attempt the launcher may make, with the backoffs between
        assert int(platform["activeDeadlineSeconds"]) >= 4 * s.deadline(step) + sum(policy.delays())
        assert platform["podMetadata"]["labels"] == {"ardit.io/kv-client": "true"}
        assert platform["secretAsEnv"][0]["secretName"] == "ardit-s3"
        assert {e["envVar"] for e in platform["configMapAsEnv"][0]["keyToEnv"]} >= {"MC_PROTOCOL", "MC_DEVICE"}
        if step in ("ar", "dit"):
            assert c["image"] == IMAGES["ardit-gpu"]
            acc = c["resources"]["accelerator"]
            assert acc["resourceType"] == "nvidia.com/gpu"
            # tp x pp GPUs: the output of the gpus-per-model helper (of this DAG branch)
            assert re.fullmatch(r"\{\{\$\.inputs\.parameters\['pipelinechannel--gpus-per-model(-\d+)?-gpus'\]\}\}",
                                acc["resourceCount"])
            assert platform["emptyDirMounts"] == [{"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi",
                                                   "volumeName": "shm"}]
            assert platform["nodeSelector"]["labels"] == {"ardit.io/pool": step}
            assert opts["--weights-pvc"] == "{{$.inputs.parameters['weights_pvc']}}"
            args = c["args"]
            assert args[args.index("--tensor-parallel-size") + 1] == "{{$.inputs.parameters['tensor_parallel_size']}}"
            assert args[args.index("--pipeline-parallel-size") + 1] == \
                "{{$.inputs.parameters['pipeline_parallel_size']}}"
            assert args[args.index("--quantization") + 1] == "{{$.inputs.parameters['quantization']}}"
        else:
            assert c["image"] == IMAGES["ardit-tools"]
            assert "accelerator" not in c["resources"] and "emptyDirMounts" not in platform


def test_kfp_pools_follow_settings(tmp_path):
    from pipeline.kfp_pipelines import compile_pipelines

    s = ClusterSettings(ar_pool=Pool(cpu="4", memory="32Gi", gpu=True, node_selector={"pool": "h100"},
                                     tolerations=(Toleration(key="dedicated", operator="Equal", value="ar"),),
                                     shm_size="32Gi"),
                        max_parallel_shards=7)
    compile_pipelines(str(tmp_path), s)
    spec, k8s = _kfp_docs(tmp_path / "batch_edit.yaml")
    ar = spec["deploymentSpec"]["executors"]["exec-ar"]["container"]
    assert ar["resources"]["resourceMemoryLimit"] == "32Gi"
    assert k8s["exec-ar"]["nodeSelector"]["labels"] == {"pool": "h100"}
    assert k8s["exec-ar"]["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ar",
                                              "effect": "NoSchedule"}]
    assert k8s["exec-ar"]["emptyDirMounts"][0]["sizeLimit"] == "32Gi"
    loops = [t for tasks in _branches(spec).values() for n, t in tasks.items() if n.startswith("for-loop")]
    assert [t["iteratorPolicy"]["parallelismLimit"] for t in loops] == [7, 7]


def test_image_pull_secrets_reach_every_pod_of_both_engines(tmp_path, kfp_dir):
    """A private registry: the settings' pull secrets on every KFP task and every Argo workflow
    (the Argo pods of the default settings carry none: nothing to create for a public registry)."""
    from pipeline.argo import render_all
    from pipeline.kfp_pipelines import compile_pipelines

    s = ClusterSettings(image_pull_secrets=("regcred",))
    compile_pipelines(str(tmp_path), s)
    for path in tmp_path.glob("*.yaml"):
        _, k8s = _kfp_docs(path)
        assert k8s and all([p["secretName"] for p in ex["imagePullSecret"]] == ["regcred"] for ex in k8s.values()), path
    for path in kfp_dir.glob("*.yaml"):
        assert all("imagePullSecret" not in ex for ex in _kfp_docs(path)[1].values())
    for name, text in render_all(s).items():
        doc = yaml.safe_load(text)["spec"]
        assert doc.get("workflowSpec", doc)["imagePullSecrets"] == [{"name": "regcred"}], name
    for name, text in render_all().items():
        doc = yaml.safe_load(text)["spec"]
        assert "imagePullSecrets" not in doc.get("workflowSpec", doc), name
    assert ClusterSettings.from_yaml(_yaml(tmp_path, "image_pull_secrets: [regcred]\n")).image_pull_secrets == (
        "regcred",)


def _yaml(tmp_path, text: str):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_kfp_accuracy_sweep(kfp_dir):
    from pipeline.cluster import SWEEP_OUTPUT

    spec, k8s = _kfp_docs(kfp_dir / "accuracy_sweep.yaml")
    branches = _branches(spec)
    for branch, tasks in branches.items():
        (name, task), = [(n, t) for n, t in tasks.items() if n != "_condition"]
        assert "retryPolicy" not in task
        ex = k8s[task["componentRef"]["name"].replace("comp-", "exec-")]
        assert ex["configMapAsVolume"][0]["mountPath"] == "/spec"
        assert ex["configMapAsVolume"][0]["configMapNameParameter"]["componentInputParameter"].endswith(
            "spec_config_map")
        mounts = {m["mountPath"] for m in ex["pvcMount"]}
        assert mounts == ({SWEEP_OUTPUT, "/weights"} if branch == "weights-pvc" else {SWEEP_OUTPUT})
        assert ex["emptyDirMounts"][0]["mountPath"] == "/dev/shm"
    c = spec["deploymentSpec"]["executors"]["exec-sweep"]["container"]
    assert c["command"][-3:] == ["python", "-m", "pipeline.sweep"]
    assert _launcher_options(c["command"])["--no-retry-exit-codes"] == "1,2"  # a failed gate is a result
    assert c["args"][:2] == ["sweep", "/spec/spec.yaml"] and "--resume" in c["args"]
    assert c["resources"]["accelerator"]["resourceCount"].endswith("tensor_parallel_size']}}")


def test_kfp_scheduled_pipeline_takes_its_run_id_from_the_schedule(kfp_dir, tmp_path):
    from kfp import dsl

    from pipeline.kfp_pipelines import SCHEDULED_PIPELINE

    spec, _ = _kfp_docs(kfp_dir / f"{SCHEDULED_PIPELINE}.yaml")
    assert "run_id" not in spec["root"]["inputDefinitions"]["parameters"]
    run_id = _dag_tasks(spec)["scheduled-run-id"]
    assert run_id["inputs"]["parameters"]["schedule_time"]["runtimeValue"]["constant"] == \
        dsl.PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER
    shard = next(t for tasks in _branches(spec).values() for n, t in tasks.items() if n.startswith("shard")
                 and "indices" not in n)
    assert shard["inputs"]["parameters"]["run_id"]["componentInputParameter"].startswith("pipelinechannel--scheduled")
    # the helper really turns a schedule time into the Argo cron's run id, and refuses a missing one
    c = spec["deploymentSpec"]["executors"]["exec-scheduled-run-id"]["container"]
    out, not_after = tmp_path / "run_id", tmp_path / "not_after"
    deadline = c["args"][2]  # cron_deadline_seconds, compiled in
    assert deadline == str(ClusterSettings().cron_deadline_seconds)
    subprocess.run([sys.executable, *c["command"][1:], "2026-11-22T02:00:00Z", str(out), deadline, str(not_after)],
                   check=True)
    assert out.read_text() == "scheduled-20261122T020000Z"
    # the whole-run deadline (KFP has none for a run): the slot plus cron_deadline_seconds, as Unix time
    assert int(not_after.read_text()) == 1795312800 + ClusterSettings().cron_deadline_seconds
    done = subprocess.run([sys.executable, *c["command"][1:], "", str(out), deadline, str(not_after)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "not a scheduled run" in done.stderr


def test_kfp_scheduled_steps_enforce_the_run_deadline_and_others_have_none(kfp_dir):
    """Every step of the scheduled pipeline hands the helper's deadline to its launcher
    (--not-after); the pipelines started by hand pass an empty one (no deadline beyond the pods')."""
    from pipeline.kfp_pipelines import SCHEDULED_PIPELINE

    for name in ("generate_dataset", SCHEDULED_PIPELINE):
        spec, _ = _kfp_docs(kfp_dir / f"{name}.yaml")
        steps = []
        for comp in spec["components"].values():
            for task_name, task in comp.get("dag", {}).get("tasks", {}).items():
                value = task.get("inputs", {}).get("parameters", {}).get("not_after")
                if value is None:
                    continue
                steps.append(task_name.rstrip("-2"))
                if name == SCHEDULED_PIPELINE:
                    assert value == {"componentInputParameter": "pipelinechannel--scheduled-run-id-not_after"}
                else:
                    assert value == {"runtimeValue": {"constant": ""}}
        assert sorted(steps) == sorted(["shard", "ar", "dit", "summary"] * 2)  # in both branches (weights PVC or not)
        for ex_name, ex in spec["deploymentSpec"]["executors"].items():
            c = ex["container"]["command"]
            if c[:3] == ["python", "-m", "pipeline.launch"]:
                assert _launcher_options(c)["--not-after"] == "{{$.inputs.parameters['not_after']}}", ex_name


def test_gpus_per_model_helper_multiplies_tp_and_pp(kfp_dir, tmp_path):
    """The helper whose output sizes every AR / DiT pod really prints tp x pp, and feeds both steps."""
    spec, _ = _kfp_docs(kfp_dir / "batch_edit.yaml")
    c = spec["deploymentSpec"]["executors"]["exec-gpus-per-model"]["container"]
    out = tmp_path / "gpus"
    subprocess.run([sys.executable, *c["command"][1:], "2", "4", str(out)], check=True)
    assert out.read_text() == "8"
    for branch, tasks in _branches(spec).items():
        loop = next(t for n, t in tasks.items() if n.startswith("for-loop"))
        producer = loop["inputs"]["parameters"]
        (channel,) = [k for k in producer if "gpus-per-model" in k]
        assert producer[channel]["taskOutputParameter"]["outputParameterKey"] == "gpus"


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


def _check_step_template(tpl: dict, step: str, with_weights: bool, s: ClusterSettings) -> None:
    from pipeline.cluster import GPU_STEPS, MODEL_STEPS

    c = tpl["container"]
    assert c["image"] == (s.gpu_image if step in GPU_STEPS else s.tools_image)  # kustomize names
    assert c["command"] == step_command(step, weights_pvc="{{inputs.parameters.weights_pvc}}"
                                        if step in MODEL_STEPS else None)
    # the container runs exactly the step program's command line, with inputs filled in
    values = {p["name"]: "{{inputs.parameters." + p["name"] + "}}" for p in tpl["inputs"]["parameters"]}
    if step == "sweep":
        values |= {"spec": "/spec/spec.yaml", "output": "/sweeps"}
    assert c["args"] == step_args(step, **values)
    rs = tpl["retryStrategy"]
    # maxDuration is Argo's whole retry window from the first attempt: it must let all 4 attempts
    # wait their queue allowance and run to their deadline, with the backoffs between (30 + 60 + 120 s)
    window = 4 * (s.attempt_queue_seconds + s.deadline(step)) + 30 + 60 + 120
    assert rs["limit"] == 3 and rs["backoff"] == {"duration": "30s", "factor": 2, "maxDuration": f"{window}s"}
    never = "1, 2" if step == "sweep" else "2"
    assert f"asInt(lastRetry.exitCode) not in [{never}]" in rs["expression"]
    assert tpl["activeDeadlineSeconds"] == s.deadline(step)
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                    "capabilities": {"drop": ["ALL"]}}
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "ardit-s3"
    assert c["envFrom"] == [{"configMapRef": {"name": "ardit-endpoints", "optional": True}}]
    volumes = {v["name"]: v for v in tpl.get("volumes", [])}
    mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
    assert ("weights" in volumes) == with_weights == ("weights" in mounts)
    if with_weights:
        assert volumes["weights"]["persistentVolumeClaim"] == {"claimName": "{{inputs.parameters.weights_pvc}}",
                                                               "readOnly": True}
        assert mounts["weights"] == {"name": "weights", "mountPath": "/weights", "readOnly": True}
    if step in GPU_STEPS:
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"]["mountPath"] == "/dev/shm"
        patch = json.loads(tpl["podSpecPatch"])  # GPU count per run: tp x pp for a model step
        gpus = patch["containers"][0]["resources"]
        assert patch["containers"][0]["name"] == "main"
        want = ("{{inputs.parameters.tensor_parallel_size}}" if step == "sweep" else
                "{{=asInt(inputs.parameters.tensor_parallel_size) * asInt(inputs.parameters.pipeline_parallel_size)}}")
        assert gpus["limits"]["nvidia.com/gpu"] == gpus["requests"]["nvidia.com/gpu"] == want
        assert tpl["tolerations"][0]["key"] == "nvidia.com/gpu"
    else:
        assert "shm" not in volumes and "podSpecPatch" not in tpl
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def _check_workflow_spec(spec: dict, deadline: int) -> None:
    assert spec["activeDeadlineSeconds"] == deadline
    assert spec["automountServiceAccountToken"] is False
    assert spec["executor"] == {"serviceAccountName": "ardit-workflow"}
    assert spec["podMetadata"]["labels"] == {"ardit.io/kv-client": "true"}
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
    assert spec["podGC"]["strategy"] == "OnPodSuccess"


def _check_main(spec: dict, run_id: str) -> None:
    """main runs `pipeline` without a weights PVC, `pipeline-weights` with one; each is the full run."""
    t = _templates(spec)
    main = {x["name"]: x for x in t["main"]["dag"]["tasks"]}
    assert main["run"]["template"] == "pipeline" and main["run-weights"]["template"] == "pipeline-weights"
    assert main["run"]["when"] == "'{{workflow.parameters.weights_pvc}}' == ''"
    assert main["run-weights"]["when"] == "'{{workflow.parameters.weights_pvc}}' != ''"
    for task in main.values():
        args = {p["name"]: p["value"] for p in task["arguments"]["parameters"]}
        assert set(args) == set(RUN_PARAMETERS) and args["run_id"] == run_id
    for sfx in ("", "-weights"):
        pipeline = t["pipeline" + sfx]
        assert pipeline["parallelism"] == ClusterSettings().max_parallel_shards
        tasks = {x["name"]: x for x in pipeline["dag"]["tasks"]}
        assert tasks["shard"]["template"] == "shard" + sfx
        assert tasks["shards"]["template"] == "shard-pipeline" + sfx and tasks["shards"]["depends"] == "shard"
        assert tasks["shards"]["withSequence"] == {"count": "{{inputs.parameters.num_shards}}"}
        assert {"name": "shard", "value": "{{item}}"} in tasks["shards"]["arguments"]["parameters"]
        assert tasks["summary"]["depends"] == "shards" and tasks["summary"]["template"] == "summary"
        per_shard = {x["name"]: x for x in t["shard-pipeline" + sfx]["dag"]["tasks"]}
        assert per_shard["ar"]["template"] == "ar" + sfx and per_shard["dit"]["depends"] == "ar"


@pytest.mark.parametrize("name,kind", [("ardit-batch-edit", "edit"), ("ardit-generate-dataset", "generate")])
def test_argo_workflow_template(argo_docs, name, kind):
    from hera.workflows import WorkflowTemplate
    from hera.workflows import models as m

    doc = argo_docs[f"{name}.yaml"]
    assert doc["kind"] == "WorkflowTemplate"
    _roundtrip_equal(doc, m.WorkflowTemplate)
    assert WorkflowTemplate.from_yaml(yaml.safe_dump(doc)).name == name
    spec = doc["spec"]
    s = ClusterSettings()
    _check_workflow_spec(spec, s.workflow_deadline_seconds)
    _check_main(spec, "{{workflow.parameters.run_id}}")
    t = _templates(spec)
    for step in ("shard", "ar", "dit", "summary"):
        for with_weights in ((False, True) if step != "summary" else (False,)):
            _check_step_template(t[step + ("-weights" if with_weights else "")], step, with_weights, s)
    shard_args = {p["name"]: p["value"] for p in
                  next(x for x in t["pipeline"]["dag"]["tasks"] if x["name"] == "shard")["arguments"]["parameters"]}
    assert shard_args["kind"] == kind
    params = {p["name"]: p.get("value") for p in spec["arguments"]["parameters"]}
    assert params == RUN_PARAMETERS  # same names and defaults as KFP


def test_argo_cron(argo_docs):
    from hera.workflows import models as m

    from components.data.runs import RunLayout
    from pipeline.argo import CRON_RUN_ID, CRON_RUN_ID_KEEP

    doc = argo_docs["ardit-generate-dataset-cron.yaml"]
    assert doc["kind"] == "CronWorkflow"
    _roundtrip_equal(doc, m.CronWorkflow)
    spec = doc["spec"]
    s = ClusterSettings()
    assert spec["suspend"] is True  # ships suspended until its dataset exists
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["startingDeadlineSeconds"] == s.cron_starting_deadline_seconds
    assert spec["schedules"] == [s.cron_schedule] and spec["timezone"] == "UTC"
    wf = spec["workflowSpec"]
    # a hung slot ends before the next daily slot, so Forbid cannot block the schedule for good
    assert wf["activeDeadlineSeconds"] < 24 * 3600
    _check_workflow_spec(wf, s.cron_deadline_seconds)
    _check_main(wf, CRON_RUN_ID)
    params = {p["name"]: p.get("value") for p in wf["arguments"]["parameters"]}
    assert set(params) == set(RUN_PARAMETERS) - {"run_id"}  # model, weights_pvc, steps, ... like the templates
    assert params["dataset"] == s.cron_dataset and params["model"] == "tiny" and params["weights_pvc"] == ""
    # What Argo's expression makes of a scheduled time must be a valid run id.
    expr = re.search(r"\{\{=.*?\}\}", CRON_RUN_ID).group(0)
    resolved = CRON_RUN_ID.replace(expr, re.sub(CRON_RUN_ID_KEEP, "", "2026-11-22T02:00:00+01:00"))
    assert resolved == "scheduled-20261122T0200000100"
    RunLayout(store=None, run_id=resolved)  # raises on an id that cannot become a path
    _check_step_template(_templates(wf)["dit-weights"], "dit", True, s)


def test_cron_takes_the_real_model_and_never_tiny_with_real_weights():
    from pipeline.argo import cron_workflow

    s = ClusterSettings(cron_arguments={"model": "/weights", "weights_pvc": "hunyuan-image-3", "steps": "50",
                                        "tensor_parallel_size": "4", "quantization": "fp8"}, cron_suspended=False)
    doc = yaml.safe_load(cron_workflow(s).to_yaml())
    params = {p["name"]: p.get("value") for p in doc["spec"]["workflowSpec"]["arguments"]["parameters"]}
    assert params["model"] == "/weights" and params["weights_pvc"] == "hunyuan-image-3"
    assert params["tensor_parallel_size"] == "4" and params["quantization"] == "fp8"
    assert doc["spec"]["suspend"] is False
    with pytest.raises(ValueError, match="model='tiny' does not load from it"):
        ClusterSettings(cron_arguments={"weights_pvc": "hunyuan-image-3"})
    with pytest.raises(ValueError, match="unknown or fixed"):
        ClusterSettings(cron_arguments={"run_id": "x"})


def test_model_and_weights_rule():
    check_model_and_weights("tiny", "")
    check_model_and_weights("/weights", "pvc")
    check_model_and_weights("/weights/HunyuanImage-3.0-Instruct", "pvc")
    for model, pvc in [("tiny", "pvc"), ("tencent/HunyuanImage-3.0-Instruct", "pvc"), ("/weightsX", "pvc"),
                       ("/weights", "")]:
        with pytest.raises(ValueError, match="weights_pvc"):
            check_model_and_weights(model, pvc)


def test_argo_accuracy_sweep(argo_docs):
    from hera.workflows import models as m

    doc = argo_docs["ardit-accuracy-sweep.yaml"]
    _roundtrip_equal(doc, m.WorkflowTemplate)
    spec = doc["spec"]
    t = _templates(spec)
    main = {x["name"]: x for x in t["main"]["dag"]["tasks"]}
    assert {n: x["template"] for n, x in main.items()} == {"sweep": "sweep", "sweep-weights": "sweep-weights"}
    s = ClusterSettings()
    for name, with_weights in (("sweep", False), ("sweep-weights", True)):
        _check_step_template(t[name], "sweep", with_weights, s)
        mounts = {v["name"]: v["mountPath"] for v in t[name]["container"]["volumeMounts"]}
        assert mounts["sweep-spec"] == "/spec" and mounts["sweeps"] == "/sweeps"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["sweep-spec"]["configMap"]["name"] == "{{workflow.parameters.spec_config_map}}"
    assert volumes["sweeps"]["persistentVolumeClaim"]["claimName"] == "ardit-sweeps"


def test_documented_cron_dataset_passes_the_cron_shard_check(argo_docs, tmp_path):
    """docs/deploy.md seeds the cron's dataset: what that command writes passes the dataset check of
    the cron's shard step (its kind as wired in the CronWorkflow). It used to write an edit dataset
    for a `generate` cron: the first scheduled run failed with exit 2."""
    from components.preflight import check_dataset

    s = ClusterSettings()
    seeding = [line for line in (REPO / "docs" / "deploy.md").read_text().splitlines()
               if line.startswith("python -c") and s.cron_dataset in line]
    assert len(seeding) == 1, seeding
    code = re.fullmatch(r'python -c "(.*)"', seeding[0]).group(1)
    local = str(tmp_path / "daily.parquet")
    subprocess.run([sys.executable, "-c", code.replace(s.cron_dataset, local)], check=True, cwd=REPO,
                   env={**__import__("os").environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    cron = argo_docs["ardit-generate-dataset-cron.yaml"]["spec"]["workflowSpec"]
    kinds = {p["value"] for t in cron["templates"] for task in t.get("dag", {}).get("tasks", [])
             if task["name"] == "shard" for p in task["arguments"]["parameters"] if p["name"] == "kind"}
    assert kinds == {"generate"}
    check_dataset(local, kinds.pop())  # raises ConfigError (the shard step's exit 2) if it does not fit


def test_committed_argo_renders_equal_generated():
    from pipeline.argo import render_all

    rendered = render_all(cron=False)  # the cron is rendered with pinned images (--images), never committed
    committed = {p.name: p.read_text() for p in (MANIFESTS / "base" / "argo").glob("*.yaml")}
    assert committed == rendered, "run: ardit compile --engine argo --out manifests/base"


def test_argo_and_kfp_share_the_retry_policy(argo_docs, kfp_dir):
    """Per step, the exit codes Argo's expression never retries are the ones the KFP launcher never retries."""
    argo, argo_window = {}, {}
    for doc in argo_docs.values():
        spec = doc["spec"].get("workflowSpec", doc["spec"])
        for tpl in spec["templates"]:
            if "container" in tpl:
                codes = re.search(r"not in \[([\d, ]+)\]", tpl["retryStrategy"]["expression"]).group(1)
                argo[tpl["container"]["command"][-1]] = ",".join(c.strip() for c in codes.split(","))
                argo_window[tpl["container"]["command"][-1]] = tpl["retryStrategy"]["backoff"]["maxDuration"]
    kfp, kfp_window = {}, {}
    for path in kfp_dir.glob("*.yaml"):
        spec, k8s = _kfp_docs(path)
        for name, ex in spec["deploymentSpec"]["executors"].items():
            c = ex["container"]["command"]
            if c[:3] == ["python", "-m", "pipeline.launch"]:
                kfp[c[-1]] = _launcher_options(c)["--no-retry-exit-codes"]
                kfp_window[c[-1]] = f"{k8s[name]['activeDeadlineSeconds']}s"
    assert argo == kfp
    # the same retry window, but for the queue: Argo's maxDuration (from the first attempt) also
    # counts the time each attempt's pod may wait unscheduled; KFP retries inside one running pod
    s = ClusterSettings()
    queued = {m: f"{int(w[:-1]) + (s.retry.limit + 1) * s.attempt_queue_seconds}s" for m, w in kfp_window.items()}
    assert argo_window == queued
    assert set(argo) == {f"components.{s}" for s in ("shard", "ar", "dit", "summary")} | {"pipeline.sweep"}
    assert all("2" in codes.split(",") for codes in argo.values())


def _last_attempt_end(backoff: dict, limit: int, queue: int, run: int) -> int:
    """Seconds from the first attempt's start (Argo's maxDuration clock) until the last attempt,
    each waiting ``queue`` s unscheduled and failing at ``run`` s, ends; Argo's delays grow by
    ``factor`` without a cap (3.6)."""
    delay, t = int(backoff["duration"][:-1]), 0
    for attempt in range(limit + 1):
        t += queue + run
        if attempt < limit:
            t += delay
            delay *= backoff["factor"]
    return t


def test_argo_retry_window_lets_the_last_attempt_run_its_deadline_after_queueing(argo_docs):
    """Each attempt may wait `attempt_queue_seconds` in a GPU queue (that time is not part of its
    own deadline but is part of maxDuration): the 4th AR attempt still gets its full 6 h. Without
    the allowance 30 min of queue per attempt left it 4 h."""
    s = ClusterSettings()
    for doc in argo_docs.values():
        spec = doc["spec"].get("workflowSpec", doc["spec"])
        for tpl in spec["templates"]:
            if "container" not in tpl:
                continue
            rs, deadline = tpl["retryStrategy"], tpl["activeDeadlineSeconds"]
            window = int(rs["backoff"]["maxDuration"][:-1])
            assert _last_attempt_end(rs["backoff"], rs["limit"], s.attempt_queue_seconds, deadline) <= window
            assert _last_attempt_end(rs["backoff"], rs["limit"], s.attempt_queue_seconds + 1, deadline) > window
    without = ClusterSettings(attempt_queue_seconds=0)
    ar = yaml.safe_load(render_all(without)["ardit-batch-edit.yaml"])
    tpl = next(t for t in ar["spec"]["templates"] if t["name"] == "ar")
    window = int(tpl["retryStrategy"]["backoff"]["maxDuration"][:-1])
    assert _last_attempt_end(tpl["retryStrategy"]["backoff"], 3, 1800, 6 * 3600) > window  # the old edge


@pytest.mark.parametrize("limit", [3, 6, 8])
def test_argo_backoff_has_only_argo_3_6_fields_and_counts_uncapped_delays(limit):
    """Argo 3.6 (the oldest supported) has no `backoff.cap`: it is never written, whatever the
    limit; Argo's delays then keep doubling, and maxDuration counts them as Argo waits them."""
    from pipeline.argo import ARGO_BACKOFF_FIELDS

    s = ClusterSettings(retry=RetryPolicy(limit=limit))
    for doc in render_all(s).values():
        d = yaml.safe_load(doc)
        spec = d["spec"].get("workflowSpec", d["spec"])
        for tpl in spec["templates"]:
            if "container" in tpl:
                backoff = tpl["retryStrategy"]["backoff"]
                assert set(backoff) == set(ARGO_BACKOFF_FIELDS)
                uncapped = sum(30 * 2 ** i for i in range(limit))
                assert int(backoff["maxDuration"][:-1]) == (
                    (limit + 1) * (tpl["activeDeadlineSeconds"] + s.attempt_queue_seconds) + uncapped)


def test_compile_command_writes_both_engines(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    images = tmp_path / "images.yaml"
    images.write_text(yaml.safe_dump({"images": [{"name": k, "newName": v.split(":")[0], "newTag": v.split(":")[1]}
                                                 for k, v in IMAGES.items()]}))
    result = CliRunner().invoke(app, ["compile", "--out", str(tmp_path), "--images", str(images)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "kfp").iterdir()) == [
        "accuracy_sweep.yaml", "batch_edit.yaml", "generate_dataset.yaml", "generate_dataset_scheduled.yaml"]
    assert sorted(p.name for p in (tmp_path / "argo").iterdir()) == sorted(
        [p.name for p in (MANIFESTS / "base" / "argo").iterdir()] + ["ardit-generate-dataset-cron.yaml"])
    spec, _ = _kfp_docs(tmp_path / "kfp" / "batch_edit.yaml")
    assert spec["deploymentSpec"]["executors"]["exec-ar"]["container"]["image"] == IMAGES["ardit-gpu"]


def test_compile_without_images_writes_no_bare_image_names(tmp_path):
    """Without --images, KFP pipelines and the cron would name `ardit-gpu` / `ardit-tools`, which
    nothing rewrites: compile refuses those (exit 2) and writes only the WorkflowTemplates, whose
    names `kubectl apply -k` pins, saying so."""
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    for engine in ("all", "kfp"):
        result = CliRunner().invoke(app, ["compile", "--out", str(tmp_path / engine), "--engine", engine])
        text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())  # rich's error box, unwrapped
        assert result.exit_code == 2 and "needs pullable images" in text, text
        assert not (tmp_path / engine).exists()
    result = CliRunner().invoke(app, ["compile", "--out", str(tmp_path / "argo"), "--engine", "argo"])
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in (tmp_path / "argo" / "argo").iterdir())
    assert written == sorted(p.name for p in (MANIFESTS / "base" / "argo").iterdir())
    assert "ardit-generate-dataset-cron.yaml" not in written and "not the CronWorkflow" in result.output


def _images_file(path: Path, images: dict[str, str]) -> Path:
    path.write_text(yaml.safe_dump({"images": [{"name": k, "newName": v.split("@")[0], "digest": v.split("@")[1]}
                                               for k, v in images.items()]}))
    return path


def test_pin_images_gives_the_live_cron_new_images_and_keeps_its_state(tmp_path):
    """After a rebuild the cron (created once, never re-applied) gets the new images through
    `kubectl get -o yaml | ardit pin-images --images FILE | kubectl replace -f -`: the images become
    those of a fresh render with the new file, and everything the operator changed stays."""
    from typer.testing import CliRunner

    from pipeline.argo import cron_workflow
    from pipeline.cli_orchestration import app
    from pipeline.cluster import read_kustomize_images

    old = {n: f"reg.example:5000/ml/{n}@sha256:" + "a" * 64 for n in ("ardit-gpu", "ardit-tools")}
    new = {n: f"reg.example:5000/ml/{n}@sha256:" + "b" * 64 for n in ("ardit-gpu", "ardit-tools")}
    new_file = _images_file(tmp_path / "new.yaml", new)
    live = yaml.safe_load(cron_workflow(ClusterSettings().with_images(old)).to_yaml())
    live["metadata"] |= {"namespace": "ardit", "resourceVersion": "4711"}
    live["spec"]["suspend"] = False  # argo cron resume
    live["spec"]["schedules"] = ["0 3 * * *"]  # kubectl patch
    result = CliRunner().invoke(app, ["pin-images", "--images", str(new_file)], input=yaml.safe_dump(live))
    assert result.exit_code == 0, result.output
    pinned = yaml.safe_load(result.output)
    fresh = yaml.safe_load(cron_workflow(ClusterSettings().with_images(read_kustomize_images(new_file))).to_yaml())
    assert pinned["spec"]["workflowSpec"]["templates"] == fresh["spec"]["workflowSpec"]["templates"]
    assert pinned["spec"]["suspend"] is False and pinned["spec"]["schedules"] == ["0 3 * * *"]
    assert pinned["metadata"]["resourceVersion"] == "4711"  # replace refuses if the cron changed meanwhile
    images = {t["container"]["image"] for t in pinned["spec"]["workflowSpec"]["templates"] if "container" in t}
    assert images == set(new.values())
    unpinned = {k: v for k, v in pinned.items()}
    unpinned["spec"] = dict(pinned["spec"], workflowSpec=live["spec"]["workflowSpec"])
    assert unpinned == live  # nothing but the images changed
    other = CliRunner().invoke(app, ["pin-images", "--images", str(new_file)],
                               input=yaml.safe_dump({"kind": "Pod", "spec": {"containers": [{"image": "busybox"}]}}))
    assert other.exit_code == 2 and "has no image named" in other.output
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert ("kubectl -n ardit get cronworkflow ardit-generate-dataset-cron -o yaml \\\n"
            "  | ardit pin-images --images manifests/images/kustomization.yaml | kubectl -n ardit replace -f -") in docs


def test_submit_help_lists_every_run_parameter():
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app
    from pipeline.cluster import SWEEP_PARAMETERS

    result = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for name in list(RUN_PARAMETERS) + list(SWEEP_PARAMETERS):
        assert re.search(rf"\b{name}\b", text), name


def test_cluster_settings_from_yaml(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("gpu_image: reg/x:1\nar_pool: {cpu: '2', memory: 8Gi, gpu: true, node_selector: {a: b},\n"
                    "  tolerations: [{key: k, effect: NoExecute}]}\nretry: {limit: 5, never: [2, 3]}\n"
                    "step_deadline_seconds: {ar: 60}\ncron_arguments: {model: /weights, weights_pvc: w}\n")
    s = ClusterSettings.from_yaml(path)
    assert s.gpu_image == "reg/x:1" and s.ar_pool.tolerations == (Toleration(key="k", effect="NoExecute"),)
    assert s.retry.limit == 5 and s.retry_policy("ar").never == (2,) and s.deadline("ar") == 60
    assert s.deadline("dit") == ClusterSettings().deadline("dit")
    path.write_text("gpu_imgae: typo\n")
    with pytest.raises(ValueError, match="gpu_imgae"):
        ClusterSettings.from_yaml(path)


# ---------------------------------------------------------------- submit / schedule


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.fixture()
def images_file(tmp_path) -> str:
    path = tmp_path / "kustomization.yaml"
    path.write_text(yaml.safe_dump({"images": [{"name": k, "newName": v.split(":")[0], "newTag": v.split(":")[1]}
                                              for k, v in IMAGES.items()]}))
    return str(path)


@pytest.mark.parametrize("engine,what", [("argo", "Argo server"), ("kfp", "KFP API")])
def test_submit_to_unreachable_endpoint_fails_clearly(engine, what, images_file):
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    host = f"http://127.0.0.1:{_closed_port()}"
    result = CliRunner().invoke(app, ["submit", "--engine", engine, "--host", host, "--images", images_file,
                                      "-p", "dataset=s3://ardit/in.parquet", "-p", "output=s3://ardit/out"])
    assert result.exit_code != 0
    assert f"cannot reach the {what} at {host}" in str(result.exception) + result.output
    assert "Connection refused" in str(result.exception) + result.output


def test_submit_rejects_bad_parameters(images_file):
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    base = ["submit", "--engine", "kfp", "--host", "http://127.0.0.1:1", "--images", images_file]
    r = CliRunner().invoke(app, [*base, "-p", "dataset=x"])
    assert r.exit_code == 2 and "output" in r.output
    r = CliRunner().invoke(app, [*base, "-p", "dataset=x", "-p", "output=y", "-p", "stepz=3"])
    assert r.exit_code == 2 and "stepz" in r.output
    r = CliRunner().invoke(app, [*base, "-p", "dataset=x", "-p", "output=y", "-p", "weights_pvc=w"])
    assert r.exit_code == 2 and "does not load from it" in r.output  # never tiny on real weights
    r = CliRunner().invoke(app, [*base, "-p", "dataset=x", "-p", "output=y", "-p", "tensor_parallel_size=two"])
    assert r.exit_code == 2 and "two" in r.output
    # KFP runs what it compiles: bare kustomize names are refused before anything is sent
    r = CliRunner().invoke(app, ["submit", "--engine", "kfp", "--host", "http://127.0.0.1:1",
                                 "-p", "dataset=x", "-p", "output=y"])
    assert r.exit_code == 2 and "--images" in r.output


def test_schedule_request_matches_the_argo_cron_and_the_kfp_client(tmp_path):
    import kfp

    from pipeline.cli_orchestration import kfp_cron, recurring_run_request

    s = ClusterSettings(cron_schedule="30 3 * * 1")
    req = recurring_run_request(s, {"dataset": s.cron_dataset}, experiment_id="e1", package="p.yaml", enabled=False)
    inspect.signature(kfp.Client.create_recurring_run).bind(None, **req)  # every keyword is the client's
    assert req["cron_expression"] == "0 30 3 * * 1"  # KFP's cron has a seconds field
    assert req["max_concurrency"] == 1 and req["no_catchup"] is True and req["enabled"] is False
    assert req["job_name"] == "ardit-generate-dataset-cron"
    with pytest.raises(Exception, match="5 fields"):
        kfp_cron("0 2 * *")


def test_schedule_unreachable_and_bad_input_fail_clearly(images_file):
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    host = f"http://127.0.0.1:{_closed_port()}"
    r = CliRunner().invoke(app, ["schedule", "--host", host, "--images", images_file])
    assert r.exit_code != 0 and f"cannot reach the KFP API at {host}" in str(r.exception) + r.output
    r = CliRunner().invoke(app, ["schedule", "--host", host, "--images", images_file, "-p", "weights_pvc=w"])
    assert r.exit_code == 2 and "does not load from it" in r.output


# ---------------------------------------------------------------- step command lines


def _run_step(step: str, values: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable if a == "python" else a for a in step_command(step, weights_pvc="")]
    return subprocess.run([*command, *map(str, step_args(step, **values))], capture_output=True, text=True,
                          cwd=REPO, check=False)


def test_shard_and_summary_accept_the_wired_command_lines(tmp_path):
    """The argv the workflows run, through the launcher, is accepted by the real step programs."""
    from components.data.sample import write_sample_edit_dataset

    dataset = write_sample_edit_dataset(str(tmp_path / "in.parquet"), n=3, size=32)
    out = str(tmp_path / "out")
    done = _run_step("shard", {"dataset": dataset, "output": out, "run_id": "r1", "num_shards": 2, "kind": "edit",
                               "model": "tiny"}, tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run_step("summary", {"output": out, "run_id": "r1"}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "r1" / "summary.json").exists()
    # tiny with a weights PVC is stopped by the launcher before the step starts: exit 2, one line
    command = [sys.executable if a == "python" else a for a in step_command("shard", weights_pvc="w")]
    done = subprocess.run([*command, *map(str, step_args("shard", dataset=dataset, output=out, run_id="r2",
                                                         num_shards=1, kind="edit", model="tiny"))],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "weights_pvc" in done.stderr
    assert not (tmp_path / "out" / "r2").exists()


def test_sweep_accepts_the_wired_command_line(tmp_path):
    spec = REPO / "examples" / "sweeps" / "tiny.yaml"
    argv = step_args("sweep", spec=str(spec), output=str(tmp_path), sweep_id="s1")
    command = [sys.executable if a == "python" else a for a in step_command("sweep")]
    done = subprocess.run([*command, *argv, "--dry-run"], capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    assert "configs" in done.stdout


@pytest.mark.parametrize("step", ["ar", "dit"])
def test_gpu_steps_accept_the_compiled_command_line(argo_docs, step, monkeypatch):
    """The compiled Argo args, filled in and cleaned by the launcher, parse with the real step argparse
    and reach the step's run() config with tensor parallelism and quantization. (The DiT at --pp 1:
    the step program refuses --step-cache beside --pp 2 before any work, as the step itself does.)"""
    import importlib

    from pipeline.launch import step_argv

    tpl = _templates(argo_docs["ardit-batch-edit.yaml"]["spec"])[step]
    values = {"output": "/tmp/o", "run_id": "r", "shard": "0", "model": "tiny", "weights_pvc": "",
              "tensor_parallel_size": "2", "pipeline_parallel_size": "2" if step == "ar" else "1",
              "quantization": "fp8",
              "kv_store": "local:///tmp/kv", "bot_task": "",
              "steps": "", "guidance": "7.5", "batch_invariant": "true", "step_cache": "0.1"}
    args = [re.sub(r"\{\{inputs\.parameters\.(\w+)\}\}", lambda m: values[m.group(1)], a)
            for a in tpl["container"]["args"]]
    seen = {}
    main_module = importlib.import_module(f"components.{step}.__main__")
    # the step hands run()'s config to run_step, which starts the tensor-parallel ranks
    monkeypatch.setattr(main_module, "run_step", lambda target, kwargs, *a, **kw: seen.update(kwargs) or {})
    assert main_module.main(step_argv(args, env={})) == 0
    config = seen["config"]
    assert config.tensor_parallel_size == 2 and config.quantization == "fp8"
    assert config.pipeline_parallel_size == int(values["pipeline_parallel_size"])
    if step == "ar":
        assert config.batch_invariant is True
    else:
        assert config.step_cache == 0.1 and config.guidance == 7.5 and config.steps is None
