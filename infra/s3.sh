#!/usr/bin/env bash
# An S3-compatible endpoint (moto's server), in the foreground: MLflow's artifact store and the DVC remote of the
# local tracking stack. moto keeps objects in memory: a stand-in for tests and demos, not storage (point
# tracking at real S3 or MinIO for that). By hand:  S3_PORT=5002 infra/s3.sh
set -euo pipefail
: "${S3_PORT:=5002}"
exec moto_server -H "${S3_HOST:-127.0.0.1}" -p "$S3_PORT"
