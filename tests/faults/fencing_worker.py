"""A training worker for the fencing fault tests, run as its own process.

It reads its shards of each epoch through `ShardSampler` with manual acknowledgement, "trains"
each batch for a moment, then reports it (`ack`, `flush`: one progress report per batch) and
writes a ledger line (JSON) per batch saying what became of it:

- `drawn`: the indices of the batch, the instance (lease) each was drawn under and when
  (`time.monotonic()`, one clock for every process of the machine);
- `counted`: the report was accepted: these samples are this worker's for good;
- `refused`: the report was refused (`StaleLease`): read under a lease that ended, not counted;
- `lost`: accepted, but their shard had moved away meanwhile (`lost_shards`): read again there.

    python -m tests.faults.fencing_worker --nats-url URL --job JOB --worker-id W --ledger PATH
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import IO, Any

import strata
from strata.errors import StaleLease
from strata.torch import ShardSampler

DATASET = "ledger-ds"
SEED = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--samples", type=int, default=2400)
    parser.add_argument("--shard-size", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=0.04)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    with (
        open(args.ledger, "a", buffering=1, encoding="utf-8") as ledger,
        strata.Worker(args.job, args.nats_url, worker_id=args.worker_id) as worker,
    ):

        def note(kind: str, **fields: Any) -> None:
            _write(ledger, {"kind": kind, "worker": args.worker_id, **fields})

        registry = strata.DatasetRegistry(worker)
        registry.register_dataset(DATASET, args.samples, args.shard_size, shuffle=True, seed=SEED)
        note("started", pid=os.getpid(), instance=worker.instance)
        for epoch in range(args.epochs):
            sampler = ShardSampler(
                registry,
                DATASET,
                epoch,
                shuffle_within_shard=True,
                seed=SEED,
                manual_ack=True,
                report_every=0,  # one report per batch, by flush(): accepted or refused whole
            )
            while True:
                batch: list[tuple[int, str, float]] = []
                for index in sampler:
                    lease = sampler.lease
                    assert lease is not None
                    batch.append((index, lease.instance, time.monotonic()))
                    if len(batch) == args.batch_size:
                        _train_and_report(sampler, batch, epoch, args.step_s, args.shard_size, note)
                        batch = []
                if batch:
                    _train_and_report(sampler, batch, epoch, args.step_s, args.shard_size, note)
                if not sampler.wait_for_more(timeout=120):
                    break
            note("epoch_done", epoch=epoch, instance=worker.instance)


def _train_and_report(
    sampler: ShardSampler,
    batch: list[tuple[int, str, float]],
    epoch: int,
    step_s: float,
    shard_size: int,
    note: Any,
) -> None:
    samples = [index for index, _, _ in batch]
    note(
        "drawn",
        epoch=epoch,
        samples=samples,
        instances=[instance for _, instance, _ in batch],
        at=[at for _, _, at in batch],
    )
    time.sleep(step_s)  # the training step
    lost_before = len(sampler.lost_shards)
    try:
        sampler.ack(len(batch))
        sampler.flush()
    except StaleLease as exc:
        note("refused", epoch=epoch, samples=samples, instance=batch[0][1], error=exc.message)
        return
    lost = set(sampler.lost_shards[lost_before:])
    lost_samples = [i for i in samples if i // shard_size in lost]
    counted = [i for i in samples if i // shard_size not in lost]
    note("counted", epoch=epoch, samples=counted, instance=batch[0][1])
    if lost_samples:
        note("lost", epoch=epoch, samples=lost_samples, instance=batch[0][1])


def _write(ledger: IO[str], record: dict[str, Any]) -> None:
    ledger.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
