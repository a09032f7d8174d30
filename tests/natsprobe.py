"""Ask a real nats-server what one credential may do: which publishes get through, which
subscriptions it refuses.

Both the `strata up --secure` authorization and the one the Helm chart renders are checked with
these, so the two are held to the same rules by the same code.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from strata.events import subjects

_REFUSED = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.I)


@dataclass
class Client:
    """A raw NATS connection that keeps the server's permission refusals it was told of."""

    nc: NATS
    refused: dict[str, set[str]] = field(
        default_factory=lambda: {"publish": set(), "subscription": set()}
    )
    errors: list[str] = field(default_factory=list)

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()


async def connect(url: str, user: str, password: str, inbox_prefix: str | None = None) -> Client:
    client: Client | None = None
    early: list[str] = []

    async def on_error(exc: Exception) -> None:
        text = str(exc)
        target = client.errors if client is not None else early
        target.append(text)
        if client is not None:
            _note(client, text)

    options = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
    nc = await nats.connect(
        url,
        user=user,
        password=password,
        error_cb=on_error,
        allow_reconnect=False,
        **options,  # type: ignore[arg-type]
    )
    client = Client(nc)
    for text in early:
        client.errors.append(text)
        _note(client, text)
    return client


def _note(client: Client, text: str) -> None:
    # nats-py lowercases the server's error text, subjects included: compare them lowercased.
    for kind, subject in _REFUSED.findall(text):
        client.refused[kind.lower()].add(_as_sent(subject).lower())


def _as_sent(subject: str) -> str:
    """A request subject as its sender wrote it: nats-server checks (and names in a refusal) the
    subject its mapping moved the request to, in the job's partition."""
    if not subject.lower().startswith(subjects.RPC_PARTITIONED + "."):
        return subject
    try:
        return subjects.rpc_subject(*subjects.parse_rpc_subject(subject))
    except ValueError:
        return subject


async def refused_subscriptions(client: Client, wanted: list[str]) -> set[str]:
    """Which of `wanted` the server refuses `client` to subscribe to (each is tried; allowed ones
    are unsubscribed again)."""
    subs = [await client.nc.subscribe(subject) for subject in wanted]
    await settled(client)
    refused = client.refused["subscription"]
    for sub in subs:
        if sub.subject.lower() not in refused:
            await sub.unsubscribe()
    await client.nc.flush()
    return {subject for subject in wanted if subject.lower() in refused}


async def settled(client: Client) -> None:
    """Until the server has answered everything `client` sent so far.

    The server answers a refused SUB or PUB with an error before the PONG of a later PING, and
    nats-py hands each error to its callback before it reads on. One flush is not proof: nats-py
    writes the PING straight to the socket, ahead of what is still in its write buffer; by the
    second flush that has been written, and that PONG comes after the server's answers to it.
    """
    await client.nc.flush()
    await client.nc.flush()


async def reached(watcher: NATS, sender: Client, sent: list[str], marker: str) -> set[str]:
    """Which of the `sent` subjects reached `watcher` (a connection that may subscribe to
    everything) from `sender`, which then publishes `marker`, a subject it may publish: one
    connection's messages arrive in order, so once the marker is in, everything that got
    through before it is too."""
    seen: set[str] = set()
    done = asyncio.Event()
    listening = asyncio.Event()
    probe = "strata.probe.watcher"

    async def on_message(msg: Msg) -> None:
        if msg.subject == marker:
            done.set()
        elif msg.subject == probe:
            listening.set()
        elif msg.subject in sent:
            seen.add(msg.subject)
        elif _as_sent(msg.subject) in sent:  # a request the server moved to its partition
            seen.add(_as_sent(msg.subject))

    subs = [await watcher.subscribe(s, cb=on_message) for s in (">", marker)]
    # nats-py's flush() can overtake a SUB still in its write buffer; a message of the watcher's
    # own, queued behind the SUBs, proves the server has them.
    await watcher.publish(probe, b"")
    await asyncio.wait_for(listening.wait(), 10)
    for subject in sent:
        await sender.nc.publish(subject, b"x")
    await sender.nc.publish(marker, b"end")
    await sender.nc.flush()
    await asyncio.wait_for(done.wait(), 10)
    for sub in subs:
        await sub.unsubscribe()
    return seen
