#!/usr/bin/env bash
# Start PostgreSQL and Redis on 127.0.0.1 when they are not already running, and create the
# `nightwatch` database. Idempotent; used by `make test` and CI.
set -euo pipefail

pg_up() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

if ! pg_up; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
  for _ in $(seq 1 50); do pg_up && break; sleep 0.2; done
  pg_up || { echo "PostgreSQL did not start" >&2; exit 1; }
fi
if ! redis_up; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 50); do redis_up && break; sleep 0.2; done
  redis_up || { echo "Redis did not start" >&2; exit 1; }
fi
psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='nightwatch'" | grep -q 1 \
  || psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE nightwatch"
