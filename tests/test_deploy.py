"""The scheduling recipes in deploy/: each manifest parses and validates, each entrypoint
runs our job (``--print-config``), and the docs show them.

- ``deploy/kuberay/rayjob-summarize.yaml`` (KubeRay ``RayJob``): no package ships KubeRay's
  CRD, so the spec is checked against the fields KubeRay's API reference documents for
  ``ray.io/v1`` (:data:`RAYJOB_SCHEMA`: names, types, required fields; an unknown or
  misspelt field fails), and its pod templates against Kubernetes' own ``PodTemplateSpec``
  schema (``kubernetes-validate``).  Point ``SPECBATCH_KUBERAY_CRD`` at KubeRay's
  ``ray.io_rayjobs.yaml`` to validate against the CRD's OpenAPI schema as well.
- ``deploy/kuberay/cronjob-summarize.yaml`` (CronJob and its RBAC): Kubernetes' schemas,
  strict; its shell script is run with ``kubectl`` replaced by ``cat``.
- ``deploy/airflow/specbatch_nightly.py``: Apache Airflow is not installed here (a full
  Airflow with its scheduler, database and API server is far heavier than the rest of the
  test environment), so the DAG is checked by parsing it (``ast``), rendering its Jinja
  command, and parsing that with Ray's own ``ray job submit`` command line.
"""

from __future__ import annotations

import ast
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
RAYJOB = DEPLOY / "kuberay" / "rayjob-summarize.yaml"
CRONJOB = DEPLOY / "kuberay" / "cronjob-summarize.yaml"
DAG = DEPLOY / "airflow" / "specbatch_nightly.py"
K8S_VERSION = "1.33"


def _obj(props: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


_ANY_OBJ = {"type": "object"}
_POD_TEMPLATE = {"type": "object"}  # checked against Kubernetes' PodTemplateSpec below
_INT, _STR, _BOOL = {"type": "integer"}, {"type": "string"}, {"type": "boolean"}
_HEAD = _obj({"template": _POD_TEMPLATE, "rayStartParams": {"type": "object", "additionalProperties": _STR},
              "serviceType": _STR, "headService": _ANY_OBJ, "enableIngress": _BOOL}, ("template",))
_WORKER = _obj({"groupName": _STR, "replicas": _INT, "minReplicas": _INT, "maxReplicas": _INT,
                "idleTimeoutSeconds": _INT, "rayStartParams": {"type": "object", "additionalProperties": _STR},
                "template": _POD_TEMPLATE, "scaleStrategy": _ANY_OBJ, "numOfHosts": _INT, "suspend": _BOOL},
               ("groupName", "template"))
_CLUSTER = _obj({"rayVersion": _STR, "enableInTreeAutoscaling": _BOOL, "autoscalerOptions": _ANY_OBJ,
                 "headServiceAnnotations": _ANY_OBJ, "headGroupSpec": _HEAD,
                 "workerGroupSpecs": {"type": "array", "items": _WORKER}, "suspend": _BOOL, "managedBy": _STR,
                 "gcsFaultToleranceOptions": _ANY_OBJ, "authOptions": _ANY_OBJ}, ("headGroupSpec",))
#: RayJob (ray.io/v1) as KubeRay's API reference documents it (RayJobSpec, RayClusterSpec,
#: HeadGroupSpec, WorkerGroupSpec; fields we do not set are listed without detail)
RAYJOB_SCHEMA = _obj({
    "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayJob"},
    "metadata": _ANY_OBJ,
    "spec": _obj({
        "entrypoint": _STR, "runtimeEnvYAML": _STR, "jobId": _STR, "metadata": _ANY_OBJ,
        "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
        "entrypointResources": _STR, "entrypointNumCpus": {"type": "number"}, "entrypointNumGpus": {"type": "number"},
        "shutdownAfterJobFinishes": _BOOL, "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
        "activeDeadlineSeconds": {"type": "integer", "minimum": 1}, "backoffLimit": {"type": "integer", "minimum": 0},
        "suspend": _BOOL, "rayClusterSpec": _CLUSTER, "clusterSelector": _ANY_OBJ, "submitterPodTemplate": _ANY_OBJ,
        "submitterConfig": _ANY_OBJ, "managedBy": _STR, "deletionStrategy": _ANY_OBJ,
    }, ("entrypoint",)),
}, ("apiVersion", "kind", "metadata", "spec"))


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _k8s_validate(doc: dict) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{doc['kind']}: {'.'.join(map(str, e.path))}: {e.message}")


def _pod_template(template: dict) -> None:
    _k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


def _print_config(entrypoint: str, env: dict | None = None, cwd: Path = REPO) -> dict:
    """Run a job entrypoint with ``--print-config`` (image paths mapped onto this checkout,
    ``python`` onto this interpreter) under a shell, as Ray's job supervisor runs it."""
    cmd = entrypoint.replace("/opt/specbatch/", f"{REPO}/")
    assert cmd.startswith("python "), cmd
    cmd = shlex.quote(sys.executable) + cmd[len("python"):] + " --print-config"
    proc = subprocess.run(["/bin/sh", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


# ------------------------------------------------------------------ KubeRay RayJob

def test_the_rayjob_validates_against_kuberays_documented_fields():
    import jsonschema
    import ray

    (job,) = _docs(RAYJOB)
    jsonschema.validate(job, RAYJOB_SCHEMA)
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["submissionMode"] == "K8sJobMode"
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__  # the image's Ray is the project's
    _pod_template(cluster["headGroupSpec"]["template"])
    gpus = 0
    for group in cluster["workerGroupSpecs"]:
        _pod_template(group["template"])
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus += group["replicas"] * int(limits.get("nvidia.com/gpu", 0))
    assert f"FROM rayproject/ray:{ray.__version__}-" in (DEPLOY / "Dockerfile").read_text()  # the image's base
    for c in [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]] + \
             [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]:
        assert f"ray{ray.__version__}" in c["image"], c["image"]
    # the GPU workers hold the job's actor pool
    args = shlex.split(spec["entrypoint"])
    actors, per_actor = int(args[args.index("--num-actors") + 1]), float(args[args.index("--gpus-per-actor") + 1])
    assert gpus >= actors * per_actor > 0
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert all(isinstance(v, str) for v in env.values()) and "SPECBATCH_RUN_DATE" in env  # Ray wants strings


def test_the_rayjob_validates_against_the_kuberay_crd_when_given():
    path = os.environ.get("SPECBATCH_KUBERAY_CRD")
    if not path:
        pytest.skip("no KubeRay CRD ships in a package: set SPECBATCH_KUBERAY_CRD to ray.io_rayjobs.yaml to check it")
    import jsonschema

    (crd,) = _docs(Path(path))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    (job,) = _docs(RAYJOB)
    jsonschema.validate(job, version["schema"]["openAPIV3Schema"])


def test_the_rayjob_entrypoint_runs_the_job_with_its_run_date():
    (job,) = _docs(RAYJOB)
    cfg = _print_config(job["spec"]["entrypoint"], env={"SPECBATCH_RUN_DATE": ""})  # as created by hand
    assert cfg["output"]["run_date"] == _today() and cfg["output"]["partition_by_date"] is True
    assert cfg["output"]["uri"] == "s3://specbatch-nightly/summaries/" and cfg["compute"]["num_actors"] == 2
    assert cfg["task"]["name"] == "summarize"
    assert cfg["output"]["previous"] == "auto"  # copies the rows the night before holds unchanged


# ------------------------------------------------------------------ CronJob

def test_the_cronjob_and_its_rbac_validate_against_kubernetes_schemas():
    docs = _docs(CRONJOB)
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "CronJob"]
    for doc in docs:
        _k8s_validate(doc)
    cron = docs[-1]["spec"]
    assert cron["concurrencyPolicy"] == "Forbid" and len(cron["schedule"].split()) == 5
    pod = cron["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == docs[0]["metadata"]["name"]
    (rule,) = docs[1]["rules"]
    assert rule["apiGroups"] == ["ray.io"] and "create" in rule["verbs"] and rule["resources"] == ["rayjobs"]


def test_the_cronjob_creates_the_rayjob_with_the_nights_date(tmp_path):
    (cron,) = [d for d in _docs(CRONJOB) if d["kind"] == "CronJob"]
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    script = container["command"][-1]
    assert "kubectl create -f -" in script
    mount = container["volumeMounts"][0]["mountPath"]
    script = script.replace("kubectl create -f -", "cat").replace(f"{mount}/", f"{RAYJOB.parent}/")
    proc = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    (job,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["SPECBATCH_RUN_DATE"] == _today()  # pinned: a retry after midnight keeps it
    # the job's driver gets the runtime env's variables: the entrypoint then uses that date
    cfg = _print_config(job["spec"]["entrypoint"], env={"SPECBATCH_RUN_DATE": "2026-02-03"})
    assert cfg["output"]["run_date"] == "2026-02-03" and cfg["output"]["previous"] == "auto"


# ------------------------------------------------------------------ Airflow

def _dag_module() -> tuple[ast.Module, dict[str, str]]:
    tree = ast.parse(DAG.read_text(), filename=str(DAG))
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                src = ast.unparse(node.value).replace("ENTRYPOINT", repr(consts.get("ENTRYPOINT", "")))
                consts[node.targets[0].id] = eval(src, {})  # noqa: S307 - "..." + ENTRYPOINT
    return tree, consts


def test_the_airflow_dag_parses_and_its_command_is_a_valid_ray_job_submit():
    import jinja2
    from ray.dashboard.modules.job.cli import job_cli_group

    tree, consts = _dag_module()
    imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {"airflow.sdk", "airflow.providers.standard.operators.bash"} <= imports  # Airflow 3's modules
    calls = {n.func.id: n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    dag_kw = {k.arg: k.value for k in calls["DAG"].keywords}
    assert ast.literal_eval(dag_kw["schedule"]) == "15 2 * * *"
    assert ast.literal_eval(dag_kw["catchup"]) is False and ast.literal_eval(dag_kw["max_active_runs"]) == 1
    op_kw = {k.arg: k.value for k in calls["BashOperator"].keywords}
    assert isinstance(op_kw["bash_command"], ast.Name) and op_kw["bash_command"].id == "SUBMIT"
    # the command as Airflow renders it on 2026-03-04, parsed by Ray's own CLI
    context = {"ds": "2026-03-04", "ds_nodash": "20260304", "ti": {"try_number": 2}}
    command = jinja2.Template(consts["SUBMIT"]).render(**context)
    args = shlex.split(command.replace('"$RAY_ADDRESS"', "http://head:8265"))
    assert args[:3] == ["ray", "job", "submit"]
    params = job_cli_group.commands["submit"].make_context("submit", args[3:]).params
    assert params["submission_id"] == "specbatch-summarize-20260304-2"
    assert Path(params["runtime_env"]).name == "runtime_env.yaml" and params["working_dir"] == "/opt/specbatch"
    assert (REPO / "configs" / "runtime_env.yaml").is_file()
    entrypoint = shlex.join(params["entrypoint"])
    cfg = _print_config(entrypoint, cwd=REPO)  # run from the working directory Ray uploads
    assert cfg["output"]["run_date"] == "2026-03-04" and cfg["output"]["uri"] == "s3://specbatch-nightly/summaries/"
    assert cfg["output"]["previous"] == "auto" and cfg["output"]["partition_by_date"] is True


def test_the_airflow_dag_imports_where_airflow_is_installed():
    pytest.importorskip("airflow.sdk", reason="Apache Airflow is not installed here: the DAG is checked by parsing it")
    import importlib.util

    spec = importlib.util.spec_from_file_location("specbatch_nightly", DAG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.dag.dag_id == "specbatch_summarize_nightly"


# ------------------------------------------------------------------ docs

def test_the_docs_show_each_recipe():
    pages = [REPO / "README.md"] + sorted((REPO / "docs").glob("**/*.md"))
    text = "\n".join(p.read_text() for p in pages if p.is_file())
    for path in (RAYJOB, CRONJOB, DAG):
        assert str(path.relative_to(REPO)) in text, path
    assert re.search(r"kubectl create -f deploy/kuberay/rayjob-summarize\.yaml", text)
