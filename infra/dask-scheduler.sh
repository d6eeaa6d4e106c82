#!/usr/bin/env bash
# The Dask scheduler llmopt's pipeline fans its tasks out through (cluster.runner: dask, dask_address:
# tcp://HOST:DASK_PORT), in the foreground; /health on DASK_HTTP_PORT. By hand:  DASK_PORT=8786 infra/dask-scheduler.sh
set -euo pipefail
: "${DASK_PORT:=8786}"
: "${DASK_HTTP_PORT:=$((DASK_PORT + 1))}"
exec dask scheduler --host "${DASK_HOST:-127.0.0.1}" --port "$DASK_PORT" \
  --dashboard-address "${DASK_HOST:-127.0.0.1}:$DASK_HTTP_PORT"
