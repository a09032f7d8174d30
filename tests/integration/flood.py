"""A noisy job in a process of its own: floods the services with requests as one of its workers.

`python tests/integration/flood.py URL JOB WORKER DATASET COUNT` sends, as fast as one nats-py
client can, COUNT `members` requests to the registry and COUNT `ping`s to the barrier (each with a
reply subject), and every hundredth time a `get_shards` for DATASET with no reply subject. It
prints `sent` once everything is on the wire, then, once the answers have stopped coming, one
JSON line: how many answers of each outcome (`ok` or an error code) it got.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections import Counter

import nats
from nats.aio.msg import Msg
from strata.events import pack, subjects, unpack

QUIET_S = 3.0
"""The answers have stopped once none came for this long."""
ANSWER_DEADLINE_S = 45.0


async def flood(url: str, job: str, worker: str, dataset: str, count: int) -> None:
    nc = await nats.connect(url, pending_size=256 * 1024 * 1024)
    outcomes: Counter[str] = Counter()
    last_answer = time.monotonic()

    async def on_answer(msg: Msg) -> None:
        nonlocal last_answer
        last_answer = time.monotonic()
        body = unpack(msg.data)
        outcomes["ok" if body.get("ok") else str(body["error"]["code"])] += 1

    inbox = f"_INBOX.flood{uuid.uuid4().hex[:8]}"
    await nc.subscribe(f"{inbox}.*", cb=on_answer, pending_msgs_limit=0, pending_bytes_limit=0)
    await nc.flush()
    members = subjects.rpc_subject("registry", "members", job, worker)
    members_body = pack({"job": job})
    ping = subjects.rpc_subject("barrier", "ping", job, worker)
    ping_body = pack({})
    shards = subjects.rpc_subject("sharding", "get_shards", job, worker)
    shards_body = pack({"job": job, "dataset_id": dataset, "worker_id": worker, "epoch": 0})
    print("flooding", flush=True)
    for i in range(count):
        await nc.publish(members, members_body, reply=f"{inbox}.m{i}")
        await nc.publish(ping, ping_body, reply=f"{inbox}.p{i}")
        if i % 100 == 0:
            await nc.publish(shards, shards_body)
        if i % 500 == 0:
            await asyncio.sleep(0)  # let answers in, as a real client's loop would
    await nc.flush(timeout=60)
    print("sent", flush=True)
    deadline = time.monotonic() + ANSWER_DEADLINE_S
    while time.monotonic() - last_answer < QUIET_S and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    print(json.dumps(dict(outcomes)), flush=True)
    await nc.close()


if __name__ == "__main__":
    url, job, worker, dataset, count = sys.argv[1:6]
    asyncio.run(flood(url, job, worker, dataset, int(count)))
