#!/usr/bin/env python3
"""Medians of the RESULT lines written by measure-clustered.sh, as Markdown tables.

usage: scripts/summarise-clustered.py OUT.log [OUT2.log ...]

Reads the .log files (measure-clustered.sh writes OUT.log next to OUT.jsonl): each run's
"HH:MM:SS load L: args" line, then its RESULT line, so every run is listed with the machine's
1-minute load average when it started (this 2-core machine is shared; a load far above 2 means
other sessions were compiling, and the run was slowed by them). A .jsonl file is read as bare
RESULT lines, without the load.
"""
import json
import statistics
import sys
from collections import defaultdict

ORDER = ["none", "hazelcast", "infinispan", "zookeeper"]


def read(path):
    rows = []
    load = None
    for line in open(path):
        line = line.strip()
        if path.endswith(".jsonl"):
            if line:
                rows.append(json.loads(line))
            continue
        head = line.split(": ", 1)[0].split(" ")
        if len(head) == 3 and head[1] == "load" and head[0].count(":") == 2:
            load = float(head[2])
        elif line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            r["load1"] = load
            rows.append(r)
    return rows


def fmt_run(x, load):
    return f"{x:,.0f}" + (f" (L{load:.0f})" if load is not None else "")


def main(paths):
    rows = [r for p in paths for r in read(p)]
    echo = defaultdict(list)
    ping = defaultdict(list)
    for r in rows:
        nodes = r.get("nodes", 1)
        if r["scenario"] == "echo":
            key = (r["cluster"], nodes, r["consumer"], r["delivery"], r["method"])
            echo[key].append((r["round_trips_per_s"], r.get("load1")))
        else:
            ping[(r["cluster"], nodes)].append((r["all_replies_ms"], r["first_reply_ms"], r["failures"],
                                                r.get("load1")))

    def med(xs):
        return statistics.median(x[0] for x in xs)

    print("### echo, one JVM (round trips/s; median, then every run with (L = load when it started);"
          " ratio = median / no-cluster median)\n")
    print("| cluster | consumer | delivery | method | median | runs | vs none |")
    print("|---|---|---|---|---:|---|---:|")
    for c in ORDER:
        for key in sorted(k for k in echo if k[0] == c and k[1] == 1):
            m = med(echo[key])
            base = echo.get(("none", 1) + key[2:])
            ratio = f"{m / med(base):.2f}x" if base else ""
            runs = ", ".join(fmt_run(x, load) for x, load in echo[key])
            print(f"| {c} | {key[2]} | {key[3]} | {key[4]} | {m:,.0f} | {runs} | {ratio} |")
    two = sorted(k for k in echo if k[1] == 2)
    if two:
        print("\n### echo, two JVMs (consumer/default; round trips/s)\n")
        print("| cluster | method | median | runs |")
        print("|---|---|---:|---|")
        for key in two:
            runs = ", ".join(fmt_run(x, load) for x, load in echo[key])
            print(f"| {key[0]} | {key[4]} | {med(echo[key]):,.0f} | {runs} |")
    print("\n### pingpong, 500,000 requests (all_replies_ms; median, then every run as all/first ms)\n")
    print("| cluster | nodes | median all_replies_ms | runs | failures |")
    print("|---|---:|---:|---|---:|")
    for c in ORDER:
        for nodes in (1, 2):
            xs = ping.get((c, nodes))
            if not xs:
                continue
            runs = ", ".join(f"{a}/{f}" + (f" (L{load:.0f})" if load is not None else "") for a, f, _, load in xs)
            print(f"| {c} | {nodes} | {med(xs):,.0f} | {runs} | {sum(x[2] for x in xs)} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
