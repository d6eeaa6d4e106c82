#!/usr/bin/env bash
# The MLflow tracking server, in the foreground: runs, metrics and the Model Registry in PostgreSQL, artifacts
# (variant weights, reports) in an S3 bucket that the server proxies (clients need no S3 credentials: they use
# tracking.artifacts: mlflow-artifacts:/…). Creates its database and the buckets on first start.
#   PGPORT=5433 S3_PORT=5002 MLFLOW_PORT=5001 infra/mlflow-server.sh
# Elsewhere: MLFLOW_BACKEND_STORE_URI, MLFLOW_S3_ENDPOINT_URL (or none for AWS), MLFLOW_ARTIFACTS_DESTINATION.
set -euo pipefail
: "${PGPORT:=5433}" "${S3_PORT:=5002}" "${MLFLOW_PORT:=5001}"
: "${MLFLOW_BUCKET:=llmopt-mlflow}" "${DVC_BUCKET:=llmopt-dvc}"
: "${MLFLOW_BACKEND_STORE_URI:=postgresql+psycopg://postgres@127.0.0.1:${PGPORT}/mlflow}"
: "${MLFLOW_S3_ENDPOINT_URL=http://127.0.0.1:${S3_PORT}}"
: "${MLFLOW_ARTIFACTS_DESTINATION:=s3://${MLFLOW_BUCKET}}"
export MLFLOW_S3_ENDPOINT_URL AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-llmopt}" \
  AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-llmopt}" AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
python - <<PY
import boto3, psycopg
from urllib.parse import urlparse
url = urlparse("${MLFLOW_BACKEND_STORE_URI}".replace("+psycopg", ""))
with psycopg.connect(url._replace(path="/postgres").geturl(), autocommit=True) as db:
    if not db.execute("select 1 from pg_database where datname = %s", (url.path.lstrip("/"),)).fetchone():
        db.execute(f'create database "{url.path.lstrip("/")}"')
s3 = boto3.client("s3", endpoint_url="${MLFLOW_S3_ENDPOINT_URL}" or None)
existing = {bucket["Name"] for bucket in s3.list_buckets().get("Buckets", [])}
for bucket in {"${MLFLOW_BUCKET}", "${DVC_BUCKET}"} - existing:
    s3.create_bucket(Bucket=bucket)
PY
exec mlflow server --backend-store-uri "$MLFLOW_BACKEND_STORE_URI" --artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION" \
  --host "${MLFLOW_HOST:-127.0.0.1}" --port "$MLFLOW_PORT" --workers 1
