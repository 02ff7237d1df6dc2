#!/bin/sh
# Starts the Debian PostgreSQL cluster if it is stopped, makes sure the role and database
# `cube_test` exist, and prints the URL tests read from CUBE_TEST_PG_URL:
#
#   export CUBE_TEST_PG_URL="$(deploy/postgres-test.sh)"
#
# Idempotent. Needs root (it runs psql as the `postgres` system user). Each test creates its own
# schema inside this database, so tests may run in parallel.
set -eu

VERSION="${CUBE_PG_VERSION:-15}"
CLUSTER="${CUBE_PG_CLUSTER:-main}"
PASSWORD="${CUBE_TEST_PG_PASSWORD:-cube_test}"

if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "postgres-test.sh: pg_ctlcluster not found (apt-get install postgresql)" >&2
    exit 1
fi

status="$(pg_lsclusters -h 2>/dev/null | awk -v v="$VERSION" -v c="$CLUSTER" '$1 == v && $2 == c { print $4 }')"
if [ -z "$status" ]; then
    echo "postgres-test.sh: no PostgreSQL cluster $VERSION/$CLUSTER (pg_lsclusters)" >&2
    exit 1
fi
if [ "$status" != "online" ]; then
    pg_ctlcluster "$VERSION" "$CLUSTER" start >&2
fi
port="$(pg_lsclusters -h | awk -v v="$VERSION" -v c="$CLUSTER" '$1 == v && $2 == c { print $3 }')"

# Wait until it accepts connections (start returns before that on a slow machine).
i=0
until su postgres -c "psql -p $port -Atqc 'select 1'" >/dev/null 2>&1; do
    i=$((i + 1))
    if [ "$i" -gt 100 ]; then
        echo "postgres-test.sh: cluster $VERSION/$CLUSTER does not answer on port $port" >&2
        exit 1
    fi
    sleep 0.1
done

psql_su() {
    su postgres -c "psql -p $port -v ON_ERROR_STOP=1 -Atq $*"
}

if [ "$(psql_su "-c \"select 1 from pg_roles where rolname = 'cube_test'\"")" != "1" ]; then
    psql_su "-c \"create role cube_test login password '$PASSWORD'\"" >&2
else
    psql_su "-c \"alter role cube_test login password '$PASSWORD'\"" >&2
fi
if [ "$(psql_su "-c \"select 1 from pg_database where datname = 'cube_test'\"")" != "1" ]; then
    psql_su "-c \"create database cube_test owner cube_test\"" >&2
fi

echo "postgres://cube_test:${PASSWORD}@127.0.0.1:${port}/cube_test"
