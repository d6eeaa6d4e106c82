#!/usr/bin/env bash
# A Prefect worker on the work pool PREFECT_WORK_POOL (process type; created if missing), in the foreground: it runs
# the flow runs of deployments on that pool (llmopt schedule with schedule.work_pool) as processes of this
# machine; /health on PREFECT_WORKER_WEBSERVER_PORT. By hand:
#   PREFECT_API_URL=http://127.0.0.1:4200/api PREFECT_WORK_POOL=llmopt infra/prefect-worker.sh
set -euo pipefail
: "${PREFECT_API_URL:?set PREFECT_API_URL (the Prefect server the pool lives on)}"
: "${PREFECT_WORK_POOL:?set PREFECT_WORK_POOL}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
exec prefect worker start --pool "$PREFECT_WORK_POOL" --type process --with-healthcheck
