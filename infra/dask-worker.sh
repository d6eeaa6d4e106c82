#!/usr/bin/env bash
# One Dask worker process (1 thread: each task uses target.threads cores of its own) for llmopt's pipeline, in the
# foreground; /health on DASK_WORKER_HTTP_PORT. It needs the project's environment (make install) and, on another
# machine, cluster.store for the bytes. DASK_RESOURCES="benchmark=1" on exactly one worker per machine of the target
# hardware: benchmarks run only there, one at a time. No nanny: a killed worker stays dead (its tasks move to the
# others) instead of being restarted behind the scheduler's back. By hand:
#   DASK_SCHEDULER=tcp://127.0.0.1:8786 DASK_WORKER_NAME=w0 DASK_RESOURCES=benchmark=1 infra/dask-worker.sh
set -euo pipefail
: "${DASK_SCHEDULER:?set DASK_SCHEDULER (tcp://host:port of the scheduler)}"
: "${DASK_WORKER_NAME:=$(hostname)-$$}"
args=(--nthreads 1 --no-nanny --name "$DASK_WORKER_NAME")
[[ -n "${DASK_RESOURCES:-}" ]] && args+=(--resources "$DASK_RESOURCES")
[[ -n "${DASK_WORKER_HTTP_PORT:-}" ]] && args+=(--dashboard-address "127.0.0.1:$DASK_WORKER_HTTP_PORT")
export DASK_DISTRIBUTED__WORKER__DAEMON=False  # a benchmark starts a fresh interpreter of its own
exec dask worker "$DASK_SCHEDULER" "${args[@]}"
