"""Re-applying the manifests after an image rebuild: what `kubectl apply -k` sends the second time,
with new digests, must pass the Kubernetes schemas and change no field the API server refuses to
change on an existing object (a Job's pod template, a workload's selector, a PVC's spec, ...).

No cluster here: every kustomization docs/deploy.md applies with `kubectl apply -k` is rendered
twice (images pinned by two different digests, as images/build.sh and section 1 leave them) and the
two renders are compared by the rules below, the ones the API server enforces on update.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = (REPO / "docs" / "deploy.md").read_text()
KUBECTL = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
K8S_VERSION = "1.30.0"


def _get(obj: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _spec_except(spec: dict, mutable: set[str]) -> dict:
    return {k: v for k, v in (spec or {}).items() if k not in mutable}


# Fields the API server refuses to change on update, per kind (paths under the object), or a
# function of the object for kinds where "all of spec but ..." is the rule.
IMMUTABLE: dict[str, Any] = {
    "Job": ("spec.template", "spec.selector", "spec.completionMode"),
    "Deployment": ("spec.selector",),
    "ReplicaSet": ("spec.selector",),
    "DaemonSet": ("spec.selector",),
    # a StatefulSet's spec may change only in these fields
    "StatefulSet": lambda o: _spec_except(o.get("spec"), {"replicas", "template", "updateStrategy", "ordinals",
                                                          "persistentVolumeClaimRetentionPolicy", "minReadySeconds"}),
    # a bound PVC may only grow its storage request (and change its volume attributes class)
    "PersistentVolumeClaim": lambda o: (_spec_except(o.get("spec"), {"resources", "volumeAttributesClassName"}),
                                        _spec_except(_get(o, "spec.resources"), {"requests"})),
    "Service": ("spec.clusterIP", "spec.clusterIPs"),
    "ConfigMap": lambda o: (o.get("data"), o.get("binaryData")) if o.get("immutable") else None,
    "Secret": lambda o: (o.get("data"), o.get("stringData")) if o.get("immutable") else None,
}


def _key(doc: dict) -> tuple[str, str, str, str]:
    md = doc["metadata"]
    return doc["apiVersion"].split("/")[0], doc["kind"], md.get("namespace", ""), md.get("name", "")


def reapply_problems(first: list[dict], second: list[dict]) -> list[str]:
    """Why applying ``second`` over the objects ``first`` created would be refused ([] if it would not)."""
    problems = []
    for doc in first + second:
        if not doc["metadata"].get("name"):
            problems.append(f"{doc['kind']} with generateName only: `kubectl apply` needs a name")
    old = {_key(d): d for d in first}
    for doc in second:
        before = old.get(_key(doc))
        rule = IMMUTABLE.get(doc["kind"])
        if before is None or rule is None:
            continue
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if callable(rule):
            if rule(before) != rule(doc):
                problems.append(f"{name}: immutable spec changed")
            continue
        for path in rule:
            if _get(before, path) != _get(doc, path):
                problems.append(f"{name}: {path} is immutable and changed")
    return problems


def schema_problems(docs: list[dict]) -> list[str]:
    import kubernetes_validate

    problems = []
    for d in docs:
        if d["apiVersion"].startswith("argoproj.io/"):
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{d['kind']}/{d['metadata'].get('name')}: {e.message}")
    return problems


def documented_apply_targets() -> list[str]:
    """Every kustomization docs/deploy.md applies with `kubectl ... apply -k PATH`."""
    return sorted(set(re.findall(r"kubectl (?:-n \S+ )?apply -k (manifests/\S+)", DOCS)))


def render_with_digest(tmp_path: Path, target: str, digit: str) -> list[dict]:
    """``kubectl kustomize target`` with the images pinned by digest (docs section 1), in a copy."""
    manifests = tmp_path / f"manifests-{digit}"
    if not manifests.exists():
        shutil.copytree(REPO / "manifests", manifests)
        path = manifests / "images" / "kustomization.yaml"
        doc = yaml.safe_load(path.read_text())
        for entry in doc["images"]:
            entry.pop("newTag", None)
            entry["digest"] = "sha256:" + digit * 64
        path.write_text(yaml.safe_dump(doc))
    done = subprocess.run([KUBECTL, "kustomize", str(manifests / Path(target).relative_to("manifests"))],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_the_documented_apply_targets():
    assert documented_apply_targets() == ["manifests/kfp", "manifests/overlays/dev", "manifests/weights"]


@pytest.mark.parametrize("target", documented_apply_targets())
def test_applying_again_with_new_image_digests_is_accepted(target, tmp_path):
    first, second = render_with_digest(tmp_path, target, "a"), render_with_digest(tmp_path, target, "b")
    assert first != second  # the images did change
    assert schema_problems(first) == [] and schema_problems(second) == []
    assert reapply_problems(first, second) == []
    assert not any(d["kind"] == "Job" for d in second)  # one-off work is a CronJob template (below)


def test_reapply_rules_catch_what_the_api_server_refuses(tmp_path):
    """Negative controls: the Job that used to be applied (its image changes with every build), a
    changed selector, a resized-down-to-different PVC spec, an object with only generateName."""
    pod = {"containers": [{"name": "c", "image": "r/ardit-tools@sha256:" + "a" * 64}], "restartPolicy": "Never"}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "ardit-sweeps-init"},
           "spec": {"template": {"spec": pod}}}
    import copy

    rebuilt = copy.deepcopy(job)
    rebuilt["spec"]["template"]["spec"]["containers"][0]["image"] = "r/ardit-tools@sha256:" + "b" * 64
    assert reapply_problems([job], [rebuilt]) == ["Job/ardit-sweeps-init: spec.template is immutable and changed"]
    dev = render_with_digest(tmp_path, "manifests/overlays/dev", "a")
    sts = next(d for d in dev if d["kind"] == "StatefulSet")
    moved = copy.deepcopy(sts)
    moved["spec"]["serviceName"] = "elsewhere"
    assert reapply_problems([sts], [moved]) == ["StatefulSet/mooncake-segments: immutable spec changed"]
    pvc = next(d for d in dev if d["kind"] == "PersistentVolumeClaim")
    grown, other = copy.deepcopy(pvc), copy.deepcopy(pvc)
    grown["spec"]["resources"]["requests"]["storage"] = "100Gi"
    other["spec"]["accessModes"] = ["ReadWriteMany"]
    assert reapply_problems([pvc], [grown]) == []
    assert reapply_problems([pvc], [other]) == ["PersistentVolumeClaim/ardit-sweeps: immutable spec changed"]
    dep = next(d for d in dev if d["kind"] == "Deployment")
    relabelled = copy.deepcopy(dep)
    relabelled["spec"]["selector"]["matchLabels"]["x"] = "y"
    assert reapply_problems([dep], [relabelled]) == [f"Deployment/{dep['metadata']['name']}: spec.selector is "
                                                     "immutable and changed"]
    unnamed = copy.deepcopy(job)
    unnamed["metadata"] = {"generateName": "ardit-sweeps-init-"}
    assert reapply_problems([], [unnamed]) == ["Job with generateName only: `kubectl apply` needs a name"]
    assert schema_problems([{**pvc, "spec": {**pvc["spec"], "bogus": 1}}])  # the schema check is live


@pytest.mark.parametrize("cronjob, target", [("ardit-sweeps-init", "manifests/kfp"),
                                             ("fetch-hunyuan-image-3", "manifests/weights")])
def test_one_off_jobs_are_run_from_suspended_templates_with_fresh_names(cronjob, target, tmp_path):
    """The sweeps init and the weights download run as Jobs created from a suspended CronJob (its
    job template can change on re-apply), each under a new name, collected after they finish; the
    documented wait names the same Job."""
    docs = render_with_digest(tmp_path, target, "a")
    (cj,) = [d for d in docs if d["kind"] == "CronJob" and d["metadata"]["name"] == cronjob]
    assert cj["spec"]["suspend"] is True
    assert cj["spec"]["jobTemplate"]["spec"]["ttlSecondsAfterFinished"] > 0
    # docs: VAR=NAME-$(date +%s); kubectl -n NS create job --from=cronjob/NAME $VAR; ... wait ... job/$VAR
    fresh = re.search(rf"^(\w+)={cronjob}-\$\(date \+%s\)", DOCS, re.M)
    assert fresh, f"docs/deploy.md does not name a fresh Job for {cronjob}"
    var = fresh.group(1)
    rest = DOCS[fresh.end():]
    create = re.search(rf"kubectl -n (\S+) create job --from=cronjob/{cronjob} \${var}\n", rest)
    assert create, f"docs/deploy.md does not create the Job from cronjob/{cronjob}"
    assert re.search(rf"kubectl -n {re.escape(create.group(1))} wait --for=condition=complete --timeout=\S+ "
                     rf"job/\${var}\b", rest[create.end():])
