#!/usr/bin/env bash
# The MLflow tracking server, in the foreground: runs, metrics and the Model Registry in PostgreSQL, artifacts
# (variant weights, reports) in an S3 bucket that the server proxies (clients need no S3 credentials: they use
# tracking.artifacts: mlflow-artifacts:/…). Creates its database when missing.
#   The local stack (`llmopt services up`):  PGPORT=5433 S3_PORT=5002 MLFLOW_PORT=5001 infra/mlflow-server.sh
#     uses the password postgres.sh generated ($PGPASSWORD_FILE) and moto on S3_PORT, creating its buckets.
#   Real stores: MLFLOW_BACKEND_STORE_URI=postgresql+psycopg://user:password@host/db and
#     MLFLOW_ARTIFACTS_DESTINATION=s3://bucket/prefix (credentials from the usual AWS chain; set
#     MLFLOW_S3_ENDPOINT_URL only for S3-compatible stores such as MinIO). Both are read from the environment,
#     so the password never shows in `ps`.
set -euo pipefail
: "${PGPORT:=5433}" "${S3_PORT:=5002}" "${MLFLOW_PORT:=5001}" "${MLFLOW_HOST:=127.0.0.1}"
: "${MLFLOW_BUCKET:=llmopt-mlflow}" "${DVC_BUCKET:=llmopt-dvc}"
if [ -z "${MLFLOW_BACKEND_STORE_URI:-}" ]; then
  : "${PGPASSWORD_FILE:?set PGPASSWORD_FILE (written by postgres.sh) or MLFLOW_BACKEND_STORE_URI}"
  MLFLOW_BACKEND_STORE_URI="postgresql+psycopg://postgres:$(cat "$PGPASSWORD_FILE")@127.0.0.1:${PGPORT}/mlflow"
fi
LOCAL_S3=0
if [ -z "${MLFLOW_ARTIFACTS_DESTINATION:-}" ]; then  # the local stack: moto, any credentials, buckets made here
  LOCAL_S3=1
  MLFLOW_ARTIFACTS_DESTINATION="s3://${MLFLOW_BUCKET}"
  export MLFLOW_S3_ENDPOINT_URL="${MLFLOW_S3_ENDPOINT_URL:-http://127.0.0.1:${S3_PORT}}"
  export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-llmopt}" AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-llmopt}"
  export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
fi
export MLFLOW_BACKEND_STORE_URI MLFLOW_ARTIFACTS_DESTINATION LOCAL_S3 MLFLOW_BUCKET DVC_BUCKET
python - <<'PY'
import os
import time
from urllib.parse import urlparse

import psycopg
from psycopg import sql

url = urlparse(os.environ["MLFLOW_BACKEND_STORE_URI"].replace("+psycopg", ""))
name = url.path.lstrip("/")
deadline = time.monotonic() + 60
while True:  # PostgreSQL accepts connections a moment before it accepts logins
    try:
        db = psycopg.connect(url._replace(path="/postgres").geturl(), autocommit=True)
        break
    except psycopg.OperationalError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
with db:
    if not db.execute("select 1 from pg_database where datname = %s", (name,)).fetchone():
        db.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
if os.environ["LOCAL_S3"] == "1":
    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    existing = {bucket["Name"] for bucket in s3.list_buckets().get("Buckets", [])}
    for bucket in {os.environ["MLFLOW_BUCKET"], os.environ["DVC_BUCKET"]} - existing:
        s3.create_bucket(Bucket=bucket)
PY
exec mlflow server --host "$MLFLOW_HOST" --port "$MLFLOW_PORT" --workers 1
