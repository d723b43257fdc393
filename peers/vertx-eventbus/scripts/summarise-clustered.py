#!/usr/bin/env python3
"""Medians of the RESULT lines written by measure-clustered.sh, as Markdown tables.

usage: scripts/summarise-clustered.py OUT.jsonl
"""
import json
import statistics
import sys
from collections import defaultdict

ORDER = ["none", "hazelcast", "infinispan", "zookeeper"]


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    echo = defaultdict(list)
    ping = defaultdict(list)
    for r in rows:
        nodes = r.get("nodes", 1)
        if r["scenario"] == "echo":
            key = (r["cluster"], nodes, r["consumer"], r["delivery"], r["method"])
            echo[key].append(r["round_trips_per_s"])
        else:
            ping[(r["cluster"], nodes)].append((r["all_replies_ms"], r["first_reply_ms"], r["failures"]))

    def med(xs):
        return statistics.median(xs)

    print("### echo, one JVM (round trips/s; median, then every run; ratio = median / no-cluster median)\n")
    print("| cluster | consumer | delivery | method | median | runs | vs none |")
    print("|---|---|---|---|---:|---|---:|")
    for c in ORDER:
        for key in sorted(k for k in echo if k[0] == c and k[1] == 1):
            m = med(echo[key])
            base = echo.get(("none", 1) + key[2:])
            ratio = f"{m / med(base):.2f}x" if base else ""
            runs = ", ".join(f"{x:,.0f}" for x in echo[key])
            print(f"| {c} | {key[2]} | {key[3]} | {key[4]} | {m:,.0f} | {runs} | {ratio} |")
    two = sorted(k for k in echo if k[1] == 2)
    if two:
        print("\n### echo, two JVMs (consumer/default; round trips/s)\n")
        print("| cluster | method | median | runs |")
        print("|---|---|---:|---|")
        for key in two:
            runs = ", ".join(f"{x:,.0f}" for x in echo[key])
            print(f"| {key[0]} | {key[4]} | {med(echo[key]):,.0f} | {runs} |")
    print("\n### pingpong, 500,000 requests (all_replies_ms; median, then every run as all/first)\n")
    print("| cluster | nodes | median all_replies_ms | runs (all/first ms) | failures |")
    print("|---|---:|---:|---|---:|")
    for c in ORDER:
        for nodes in (1, 2):
            xs = ping.get((c, nodes))
            if not xs:
                continue
            runs = ", ".join(f"{a}/{f}" for a, f, _ in xs)
            print(f"| {c} | {nodes} | {med([a for a, _, _ in xs]):,.0f} | {runs} | {sum(x[2] for x in xs)} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
