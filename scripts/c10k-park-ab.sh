#!/usr/bin/env bash
# A/B of idle-connection parking under wrk: starts `railyard node` (release
# build) with the given extra flags, warms up, runs wrk with CONNS connections
# for 8 s, and prints requests/s, the server's CPU (cores and microseconds per
# request, from /proc/<pid>/stat) and how many times connections parked.
# Run it under the bench lock:
#   flock /tmp/railyard-bench.lock scripts/c10k-park-ab.sh 10000
#   flock /tmp/railyard-bench.lock scripts/c10k-park-ab.sh 10000 --no-park-idle
set -euo pipefail
cd "$(dirname "$0")/.."
CONNS=${1:?usage: c10k-park-ab.sh CONNS [node flags...]}
shift
PORT=${PORT:-18080}
ADMIN=${ADMIN:-18081}
ulimit -n "$(ulimit -Hn)"
./target/release/railyard node --http-port "$PORT" --admin-port "$ADMIN" --stats-every 0 "$@" 2>/dev/null &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
sleep 1
wrk -t2 -c100 -d2s "http://127.0.0.1:$PORT/static/4k" >/dev/null
read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$PID/stat")
OUT=$(wrk -t2 -c"$CONNS" -d8s --latency "http://127.0.0.1:$PORT/static/4k")
read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$PID/stat")
REQ=$(echo "$OUT" | awk '/requests in/ {print $1}')
RPS=$(echo "$OUT" | awk '/Requests\/sec/ {print $2}')
ERR=$(echo "$OUT" | grep "Socket errors" || echo "no socket errors")
HZ=$(getconf CLK_TCK)
PARKS=$(curl -s "http://127.0.0.1:$ADMIN/metrics" | awk '/^railyard_http_connection_parks_total/ {print $2}')
python3 - "$CONNS" "$*" "$RPS" "$REQ" "$u0" "$s0" "$u1" "$s1" "$HZ" "$PARKS" "$ERR" <<'PY'
import sys
c, flags, rps, req, u0, s0, u1, s1, hz, parks, err = sys.argv[1:]
cpu = ((int(u1) + int(s1)) - (int(u0) + int(s0))) / int(hz)
print(f"connections={c} flags=[{flags}] req/s={rps} server_cores={cpu/8:.2f} "
      f"cpu_us_per_req={cpu*1e6/int(req):.1f} parks={parks} {err.strip()}")
PY
