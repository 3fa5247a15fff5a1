"""Airflow DAG: the nightly summarize job, submitted to a running Ray cluster with
``ray job submit`` (Airflow 3: ``airflow.sdk``; the standard provider's BashOperator).

Put this file in the DAGs folder of a deployment whose workers have ``ray`` on the PATH,
the specbatch repository at ``/opt/specbatch`` (uploaded as the job's working directory)
and ``RAY_ADDRESS`` set to the cluster's dashboard (``http://<head>:8265``).

``--run-date {{ ds }}``: the run's logical date, the same on every retry and backfill, so a
retry resumes the shards its first try committed, and clearing an old run redoes only its
missing shards.  ``max_active_runs=1``: two nights never write at once.  ``--previous auto``:
the rows the latest earlier complete night holds unchanged are copied, not decoded (a
backfill of an old date copies from the night complete before it).
"""

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

#: the job, as the cluster runs it (relative to the working directory Ray uploads)
ENTRYPOINT = (
    "python jobs/summarize.py --config configs/summarize.yaml"
    " --input s3://specbatch-nightly/articles/ --output s3://specbatch-nightly/summaries/"
    " --run-date {{ ds }} --previous auto --no-progress"
)

#: waits for the job and fails the task when the job fails (ray job submit's exit status)
SUBMIT = (
    'ray job submit --address "$RAY_ADDRESS" --working-dir /opt/specbatch'
    " --runtime-env /opt/specbatch/configs/runtime_env.yaml"
    " --submission-id specbatch-summarize-{{ ds_nodash }}-{{ ti.try_number }} -- " + ENTRYPOINT
)

with DAG(
    dag_id="specbatch_summarize_nightly",
    schedule="15 2 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": pendulum.duration(minutes=10)},
    tags=["specbatch"],
) as dag:
    BashOperator(task_id="summarize", bash_command=SUBMIT, execution_timeout=pendulum.duration(hours=6))
