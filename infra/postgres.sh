#!/usr/bin/env bash
# PostgreSQL in a private data folder, in the foreground: the database of the MLflow tracking server (and of the
# Prefect server when services.prefect_database_url points at it). `llmopt services up` starts it in the
# background (services.tracking_stack: true); by hand:  PGDATA=/path PGPORT=5433 infra/postgres.sh
# For one machine: it listens on 127.0.0.1 only and trusts local connections (initdb --auth=trust). A real
# deployment uses a managed PostgreSQL with passwords, and sets the URLs (README "Scaling out").
set -euo pipefail
: "${PGDATA:?set PGDATA: the data folder of the cluster}"
: "${PGPORT:=5433}"
BIN=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -1)")
mkdir -p "$PGDATA"
run_as_owner=()
if [ "$(id -u)" = 0 ]; then  # PostgreSQL refuses to run as root: as root, it runs as the postgres user
  chown postgres "$PGDATA"
  run_as_owner=(runuser -u postgres --)
fi
chmod 700 "$PGDATA"
if [ ! -f "$PGDATA/PG_VERSION" ]; then
  "${run_as_owner[@]}" "$BIN/initdb" -D "$PGDATA" --auth=trust --username=postgres --encoding=UTF8 >/dev/null
fi
exec "${run_as_owner[@]}" "$BIN/postgres" -D "$PGDATA" -p "$PGPORT" -h 127.0.0.1 -k "$PGDATA"
