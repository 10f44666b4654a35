"""A libzmq client (pyzmq) of dsa-kv's ZMQ publisher, for tests/zmq_hostile.rs.

usage: python3 libzmq_client.py PUB_ENDPOINT REPLAY_ENDPOINT BATCHES REPLAY_FROM

Subscribes with a SUB socket, says "subscribed" on stdout once its subscription has
been sent, receives BATCHES messages, then asks the replay socket for every batch from
REPLAY_FROM, once with a DEALER (empty delimiter first) and once with a REQ socket
(which reads only the first answer message), and prints one JSON line with what it got.
"""
import json
import sys

import zmq

pub, replay, batches, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.RCVTIMEO, 10000)
sub.connect(pub)
sub.setsockopt(zmq.SUBSCRIBE, b"")
print("subscribed", flush=True)
seqs = []
for _ in range(batches):
    topic, seq, payload = sub.recv_multipart()
    seqs.append(int.from_bytes(seq, "big"))

dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.RCVTIMEO, 10000)
dealer.connect(replay)
dealer.send_multipart([b"", start.to_bytes(8, "big")])
replayed = []
while True:
    empty, seq, payload = dealer.recv_multipart()
    assert empty == b"", empty
    if seq == b"\xff" * 8:
        assert payload == b""
        break
    replayed.append(int.from_bytes(seq, "big"))

req = ctx.socket(zmq.REQ)
req.setsockopt(zmq.RCVTIMEO, 10000)
req.connect(replay)
req.send(start.to_bytes(8, "big"))
seq, payload = req.recv_multipart()
print(json.dumps({
    "libzmq": zmq.zmq_version(),
    "pub": seqs,
    "replay": replayed,
    "req_first": int.from_bytes(seq, "big"),
}), flush=True)
