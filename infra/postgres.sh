#!/usr/bin/env bash
# PostgreSQL in a private data folder, in the foreground: the database of the MLflow tracking server (and of the
# Prefect server when services.prefect_database_url points at it). `llmopt services up` starts it in the
# background (services.tracking_stack: true); by hand:  PGDATA=/path PGPORT=5433 infra/postgres.sh
# It listens on 127.0.0.1 only (no Unix socket) and asks for a password (scram-sha-256): the superuser's is
# generated on first start into $PGPASSWORD_FILE (default $PGDATA.password, mode 600). A real deployment uses a
# managed PostgreSQL and passes its URL to infra/mlflow-server.sh (docs/operations.md, "The tracking stack").
set -euo pipefail
: "${PGDATA:?set PGDATA: the data folder of the cluster}"
: "${PGPORT:=5433}" "${PGPASSWORD_FILE:=$PGDATA.password}"
BIN=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -1)")
if [ -d "$PGDATA" ] && [ ! -f "$PGDATA/PG_VERSION" ] && [ -n "$(ls -A "$PGDATA")" ]; then
  echo "postgres.sh: $PGDATA is neither empty nor a PostgreSQL cluster; refusing to take it over" >&2
  exit 2
fi
mkdir -p "$PGDATA"
run_as_owner=()
if [ "$(id -u)" = 0 ]; then  # PostgreSQL refuses to run as root: as root, it runs as the postgres user
  chown postgres "$PGDATA"
  run_as_owner=(runuser -u postgres --)
fi
chmod 700 "$PGDATA"
if [ ! -f "$PGDATA/PG_VERSION" ]; then
  (umask 077 && python3 -c "import secrets; print(secrets.token_hex(16))" > "$PGPASSWORD_FILE")
  [ "$(id -u)" = 0 ] && chown postgres "$PGPASSWORD_FILE"
  "${run_as_owner[@]}" "$BIN/initdb" -D "$PGDATA" --username=postgres --pwfile="$PGPASSWORD_FILE" \
    --auth-host=scram-sha-256 --auth-local=peer --encoding=UTF8 >/dev/null
fi
exec "${run_as_owner[@]}" "$BIN/postgres" -D "$PGDATA" -p "$PGPORT" -h 127.0.0.1 -k ""
