#!/usr/bin/env bash
# The Prefect server (API + UI) that schedules and records llmopt's runs, in the foreground.
# `llmopt services up` starts it in the background with its log and pid under project.workdir/services;
# run it by hand the same way:  PREFECT_HOME=... PREFECT_PORT=4200 infra/prefect-server.sh
# PREFECT_API_DATABASE_CONNECTION_URL selects PostgreSQL (postgresql+asyncpg://…); unset, SQLite in PREFECT_HOME.
set -euo pipefail
: "${PREFECT_HOME:?set PREFECT_HOME (the server keeps its database there)}"
: "${PREFECT_PORT:=4200}"
mkdir -p "$PREFECT_HOME"
unset PREFECT_API_URL  # the server must not try to reach another server (or start a temporary one)
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
exec prefect server start --host "${PREFECT_HOST:-127.0.0.1}" --port "$PREFECT_PORT"
