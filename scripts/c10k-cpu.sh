#!/usr/bin/env bash
# Where the CPU of one request goes: starts one server (railyard's release
# build or the Vert.x peer, one verticle per core), warms it up, drives
# GET /static/4k with `wrk -t2 -cCONNS -d14s`, and prints the server's and
# wrk's user and system CPU per request (server from /proc/<pid>/stat, wrk
# from its rusage). With MODE=strace it also counts the server's system calls
# over 4 s of that load (strace -c -f); with MODE=perf it records a CPU
# profile of the server over 4 s (perf record -e cpu-clock -g) into
# c10k-<system>.perf.data in the current directory. strace slows the server:
# read the counts, not the figures of that run.
#
# Run it under the bench lock, after `cargo build --release` (for vertx, after
# one `railyard bench c10k --vs vertx`, which builds the peer):
#   flock /tmp/railyard-bench.lock scripts/c10k-cpu.sh railyard 10000
#   flock /tmp/railyard-bench.lock scripts/c10k-cpu.sh vertx 10000
#   MODE=perf flock /tmp/railyard-bench.lock scripts/c10k-cpu.sh railyard 10000
set -euo pipefail
cd "$(dirname "$0")/.."
SYSTEM=${1:?usage: c10k-cpu.sh railyard|vertx CONNS [node flags...]}
CONNS=${2:?usage: c10k-cpu.sh railyard|vertx CONNS [node flags...]}
shift 2
MODE=${MODE:-plain}
PORT=${PORT:-18080}
ADMIN=${ADMIN:-18081}
OUT_DIR=$PWD
ulimit -n "$(ulimit -Hn)"
DATA=$(mktemp -d)
head -c 12288 /dev/urandom | base64 -w0 >"$DATA/test"
case $SYSTEM in
railyard)
    ./target/release/railyard node --no-saga --http-port "$PORT" --admin-port "$ADMIN" \
        --stats-every 0 --data-dir "$DATA" "$@" 2>/dev/null &
    PID=$!
    ;;
vertx)
    JAR=peers/vertx-c10k/target/vertx-c10k-peer.jar
    [ -f "$JAR" ] || { echo "no $JAR: build the peer first (railyard bench c10k --vs vertx)" >&2; exit 2; }
    # shellcheck disable=SC2046 # one JVM flag per line
    (cd peers/vertx-c10k && exec java $(grep -v '^#' jvm.options | grep -v '^$') \
        -jar target/vertx-c10k-peer.jar --port "$PORT" --metrics-port "$ADMIN" \
        --instances "$(nproc)" --send-file "$DATA/test" --upload-dir "$DATA/uploads" \
        >/dev/null 2>&1) &
    PID=$!
    ;;
*)
    echo "unknown system $SYSTEM (railyard or vertx)" >&2
    exit 2
    ;;
esac
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true; rm -rf "$DATA"' EXIT
for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$PORT/0k" >/dev/null && break
    sleep 0.1
done
wrk -t2 -c100 -d5s "http://127.0.0.1:$PORT/static/4k" >/dev/null
read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$PID/stat")
WRK_OUT=$(mktemp)
# `times` in the subshell prints its children's (wrk's) user and system time.
(wrk -t2 -c"$CONNS" -d14s "http://127.0.0.1:$PORT/static/4k" >"$WRK_OUT"; times >>"$WRK_OUT") &
WPID=$!
sleep 6
case $MODE in
strace) timeout -s INT 4 strace -c -f -p "$PID" 2>&1 | sed -n '/% time/,/total/p' || true ;;
perf) perf record -q -e cpu-clock -g -p "$PID" -o "$OUT_DIR/c10k-$SYSTEM.perf.data" -- sleep 4 >/dev/null 2>&1 || true ;;
esac
wait $WPID
read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$PID/stat")
python3 - "$SYSTEM" "$CONNS" "$MODE" "$u0" "$s0" "$u1" "$s1" "$(getconf CLK_TCK)" "$WRK_OUT" <<'PY'
import re, sys
system, conns, mode, u0, s0, u1, s1, hz, wrk_out = sys.argv[1:]
text = open(wrk_out).read()
req = int(re.search(r"(\d+) requests in", text).group(1))
rps = re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)
errors = re.search(r"Socket errors:.*", text)
times = re.findall(r"(\d+)m([\d.]+)s", text.splitlines()[-1])
wu, ws = (int(m) * 60 + float(s) for m, s in times)
hz = int(hz)
su = (int(u1) - int(u0)) / hz * 1e6 / req
ss = (int(s1) - int(s0)) / hz * 1e6 / req
wu, ws = wu * 1e6 / req, ws * 1e6 / req
print(f"{system} connections={conns} mode={mode} req/s={rps} "
      f"{errors.group(0) if errors else 'no socket errors'}")
print(f"  server us/req: user {su:.2f} + sys {ss:.2f} = {su + ss:.2f}")
print(f"  wrk    us/req: user {wu:.2f} + sys {ws:.2f} = {wu + ws:.2f}")
PY
rm -f "$WRK_OUT"
