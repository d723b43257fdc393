#!/usr/bin/env bash
# Measures the Vert.x peer's clustered modes: seed 001's echo matrix and seed 000's pingpong, for
# no cluster and each cluster manager in one JVM, and the two-JVM runs on the chosen managers.
# Every run holds /tmp/railyard-bench.lock (benchmarks of different sessions never overlap) and
# appends its RESULT json to OUT; the sweep is repeated REPS times, interleaved, so that drift in
# the machine's speed hits every row alike. Summarise with: scripts/summarise-clustered.py OUT
#
# usage: scripts/measure-clustered.sh OUT [REPS]
# env:   DURATION (5) WARMUP (5) for one JVM, DURATION2 (10) WARMUP2 (10) for two JVMs,
#        CLUSTERS ("none hazelcast infinispan zookeeper"), CLUSTERS2 ("hazelcast"), JAR
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: measure-clustered.sh OUT [REPS]}
reps=${2:-3}
jar=${JAR:-$here/target/vertx-eventbus-peer.jar}
duration=${DURATION:-5}
warmup=${WARMUP:-5}
duration2=${DURATION2:-10}
warmup2=${WARMUP2:-10}
clusters=${CLUSTERS:-none hazelcast infinispan zookeeper}
clusters2=${CLUSTERS2:-hazelcast}
mapfile -t flags < <(grep -v '^\s*#' "$here/jvm.options" | sed '/^\s*$/d')
log=${out%.jsonl}.log

run() {
  echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): $*" | tee -a "$log"
  local line
  line=$(flock /tmp/railyard-bench.lock timeout 600 java "${flags[@]}" -jar "$jar" "$@" 2>>"$log" \
    | tee -a "$log" | grep '^RESULT ' | tail -1 || true)
  if [[ -n $line ]]; then
    echo "${line#RESULT }" >>"$out"
  else
    echo "FAILED: $*" | tee -a "$log"
  fi
}

for rep in $(seq "$reps"); do
  echo "== rep $rep" | tee -a "$log"
  for c in $clusters; do
    run pingpong --messages 500000 --cluster "$c"
    for consumer in consumer local; do
      for delivery in default local-only; do
        for method in send-reply send-send; do
          run echo --duration "$duration" --warmup "$warmup" --instances 2 --in-flight 64 \
            --consumer "$consumer" --delivery "$delivery" --method "$method" --cluster "$c"
        done
      done
    done
  done
  for c in $clusters2; do
    run pingpong --messages 500000 --cluster "$c" --nodes 2
    for method in send-reply send-send; do
      run echo --duration "$duration2" --warmup "$warmup2" --instances 2 --in-flight 64 \
        --consumer consumer --delivery default --method "$method" --cluster "$c" --nodes 2
    done
  done
done
