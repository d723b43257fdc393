"""Drives a bridge with the official Vert.x Python client (PyPI: vertx-eventbus-client).

Usage: python official_client.py PORT
Prints one JSON line per observed event, normalized so runs against Railyard
and against Vert.x's own bridge can be compared line by line (generated reply
addresses become "<reply>").
"""

import json
import sys
import threading
import time

from vertx import EventBus

PORT = int(sys.argv[1])
lock = threading.Lock()
events = []


def norm(m):
    if isinstance(m, dict):
        m = dict(m)
        for key in ("address", "replyAddress"):
            v = m.get(key)
            if isinstance(v, str) and (v.startswith("__") or len(v) == 36):
                m[key] = "<reply>"
    return m


def emit(kind, data):
    with lock:
        events.append(kind)
        print(json.dumps({"event": kind, "data": norm(data)}, sort_keys=True), flush=True)


def wait_for(kind, count, seconds=10):
    deadline = time.time() + seconds
    while time.time() < deadline:
        with lock:
            if events.count(kind) >= count:
                return
        time.sleep(0.02)
    raise SystemExit("timed out waiting for %d %s events" % (count, kind))


eb = EventBus(
    host="127.0.0.1",
    port=PORT,
    options={"connect": True, "reply_timeout": 5, "ping_interval": 1, "connection_timeout": 10},
    err_handler=lambda m: emit("err", m),
)

# Request / reply: the reply handler gets the echoed body.
eb.send("test.echo", body={"hello": "world", "n": [1, 2]}, reply_handler=lambda m: emit("reply", m))
wait_for("reply", 1)

# A failing request: the failure arrives as an err frame (and the client's own
# reply timeout fires afterwards, reported to the same handler). The timeout
# is 5 s so that no answer (a cold JVM's first ones included) misses it on a
# loaded machine.
eb.send("test.fail", body=1, reply_handler=lambda m: emit("reply", m))
wait_for("err", 2)

# Denied address.
eb.send("elsewhere", body=1)
wait_for("err", 3)


def on_in(m):
    emit("in", m)
    if m.get("replyAddress"):
        eb.send(m["replyAddress"], body={"answer": m["body"]["n"]})


# A registration: a send, a publish and a request arrive; the client answers
# the request and the server sends the answer back.
eb.register_handler("test.in", on_in)
time.sleep(1)
eb.send("test.trigger", body={"to": "test.in"})
wait_for("in", 4)

# The client's own publish reaches its own registration.
eb.publish("test.in", body="to everyone")
wait_for("in", 5)

eb.unregister_handler("test.in")
time.sleep(1)
eb.publish("test.in", body="nobody listens")
time.sleep(0.3)
eb.close()
print(json.dumps({"event": "done"}), flush=True)
