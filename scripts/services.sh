#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on loopback for the tests; start them when they do not.
# PostgreSQL: the machine's cluster (pg_ctlcluster), else a throwaway cluster (initdb, as the postgres user) on
# port 5433. Redis: redis-server --daemonize on 6379, keeping nothing on disk.
# Prints the DATABASE_URL and REDIS_URL to use, as shell assignments.
set -euo pipefail
log() { echo "services: $*" >&2; }

pg_url=""
if pg_isready -q -h 127.0.0.1 -p 5432; then
    pg_url="postgres://postgres@127.0.0.1:5432/kcaas"
else
    version=$(ls /etc/postgresql 2>/dev/null | sort -n | tail -1 || true)
    if [ -n "$version" ]; then
        log "starting the PostgreSQL $version cluster"
        pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true
        for _ in $(seq 50); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.2; done
    fi
    if pg_isready -q -h 127.0.0.1 -p 5432; then
        pg_url="postgres://postgres@127.0.0.1:5432/kcaas"
    else
        bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
        data=/tmp/kcaas-pg
        if [ ! -f "$data/PG_VERSION" ]; then
            log "initdb $data"
            mkdir -p "$data" && chown postgres "$data"
            runuser -u postgres -- "$bindir/initdb" -D "$data" -A trust -U postgres >&2
        fi
        if ! pg_isready -q -h 127.0.0.1 -p 5433; then
            log "starting a PostgreSQL cluster on 5433"
            runuser -u postgres -- "$bindir/pg_ctl" -D "$data" -l "$data/log" -w \
                -o "-p 5433 -k /tmp -c listen_addresses=127.0.0.1" start >&2
        fi
        pg_url="postgres://postgres@127.0.0.1:5433/kcaas"
    fi
fi

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    log "starting redis-server"
    mkdir -p /tmp/kcaas-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
        --dir /tmp/kcaas-redis --logfile /tmp/kcaas-redis/redis.log >&2
    for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

echo "DATABASE_URL=$pg_url"
echo "REDIS_URL=redis://127.0.0.1:6379/0"
