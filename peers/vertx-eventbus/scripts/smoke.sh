#!/usr/bin/env bash
# Functional check of every mode of the peer (not a benchmark: tiny runs). For each mode it
# checks that the run exits 0 and that its RESULT line names the right cluster and node count,
# completed round trips (echo) or every reply without failures (pingpong). Runs hold
# /tmp/railyard-bench.lock so they never disturb another session's benchmark.
#
# usage: scripts/smoke.sh [CLUSTER...]    (default: none hazelcast infinispan zookeeper)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
jar=$here/target/vertx-eventbus-peer.jar
[[ -f $jar ]] || (cd "$here" && mvn -q -B package -DskipTests)
mapfile -t flags < <(grep -v '^\s*#' "$here/jvm.options" | sed '/^\s*$/d')
clusters=("$@")
[[ ${#clusters[@]} -gt 0 ]] || clusters=(none hazelcast infinispan zookeeper)
log=$(mktemp)
failed=0

check() {
  local expect=$1
  shift
  local line
  if ! line=$(flock /tmp/railyard-bench.lock timeout 300 java "${flags[@]}" -jar "$jar" "$@" 2>>"$log" \
    | grep '^RESULT ' | tail -1); then
    echo "FAIL (exit): $*"
    failed=1
    return
  fi
  if python3 -c "import json,sys; r=json.loads(sys.argv[1][7:]); sys.exit(0 if ($expect) else 1)" "$line"; then
    echo "ok: $*"
  else
    echo "FAIL: $* -> $line"
    failed=1
  fi
}

for c in "${clusters[@]}"; do
  check "r['cluster']=='$c' and r['nodes']==1 and r['failures']==0 and r['messages']==20000" \
    pingpong --messages 20000 --cluster "$c"
  for m in send-reply send-send; do
    check "r['cluster']=='$c' and r['nodes']==1 and r['round_trips']>0" \
      echo --duration 1 --warmup 0.5 --consumer local --delivery local-only --method "$m" --cluster "$c"
  done
  [[ $c == none ]] && continue
  check "r['cluster']=='$c' and r['nodes']==2 and r['failures']==0 and r['messages']==20000" \
    pingpong --messages 20000 --cluster "$c" --nodes 2
  for m in send-reply send-send; do
    check "r['cluster']=='$c' and r['nodes']==2 and r['round_trips']>0" \
      echo --duration 2 --warmup 1 --method "$m" --cluster "$c" --nodes 2
  done
done
# --nodes 2 needs a cluster manager and a clustered consumer: usage errors (exit 2).
for bad in "--nodes 2" "--nodes 2 --cluster hazelcast --consumer local"; do
  # shellcheck disable=SC2086
  if java -jar "$jar" echo $bad >/dev/null 2>&1; then echo "FAIL: accepted: $bad"; failed=1
  elif [[ $? -eq 2 ]]; then echo "ok: rejected: $bad"; else echo "FAIL: wrong exit for: $bad"; failed=1; fi
done
# No stray server JVM or ZooKeeper is left behind.
if pgrep -f -- '--role server' >/dev/null || pgrep -f ZooKeeperServerMain >/dev/null; then
  echo "FAIL: a server JVM or ZooKeeper outlived its run"
  failed=1
fi
if [[ $failed -ne 0 ]]; then
  echo "logs: $log"
  exit 1
fi
rm -f "$log"
echo "all modes ok"
