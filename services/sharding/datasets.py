"""Registering a dataset: the request checked against the job's quotas and the datasets it has
registered, and the dataset's answer.
"""

from __future__ import annotations

from strata.errors import ConflictError, QuotaExceeded, ValidationError
from strata.events import DatasetRegistered
from strata.events.ids import event_id
from strata.events.requests import DatasetInfo, RegisterDatasetRequest
from strata.services.domain import Decision
from strata.services.sharding.state import (
    DEFAULT_LIMITS,
    SOURCE,
    JobSharding,
    ShardingLimits,
    ShardingState,
    _spec,
)

# -- decisions ------------------------------------------------------------------------------------


def register_dataset(
    state: ShardingState,
    request: RegisterDatasetRequest,
    now_ns: int,
    limits: ShardingLimits = DEFAULT_LIMITS,
) -> Decision[None]:
    wanted = _spec(request)
    datasets = state.jobs.get(request.job, JobSharding(request.job)).datasets
    existing = datasets.get(request.dataset_id)
    if existing is None and len(datasets) >= limits.max_datasets:
        return Decision(
            error=QuotaExceeded(
                f"job {request.job!r} has registered {len(datasets)} datasets, the most one job "
                "may; reuse one of them (the same id and parameters), or raise "
                "STRATA_MAX_DATASETS_PER_JOB on the sharding service"
            )
        )
    if existing is None and wanted.num_shards > limits.max_shards:
        return Decision(
            error=QuotaExceeded(
                f"dataset {request.dataset_id!r} of job {request.job!r} would have "
                f"{wanted.num_shards} shards ({request.total_samples} samples of "
                f"{request.shard_size}); one dataset may have at most {limits.max_shards}: use "
                "larger shards, or raise STRATA_MAX_SHARDS_PER_DATASET on the sharding service"
            )
        )
    if existing is not None:
        if existing == wanted:
            return Decision()
        return Decision(
            error=ConflictError(
                f"dataset {request.dataset_id!r} of job {request.job!r} is already registered "
                f"with total_samples={existing.total_samples}, shard_size={existing.shard_size}, "
                f"shuffle={existing.shuffle}, seed={existing.seed}; register it under another "
                "id to change its sharding"
            )
        )
    try:
        event = DatasetRegistered(
            id=event_id("dataset", request.job, request.dataset_id),
            job=request.job,
            source=SOURCE,
            ts=now_ns,
            dataset_id=request.dataset_id,
            total_samples=request.total_samples,
            shard_size=request.shard_size,
            shuffle=request.shuffle,
            seed=request.seed,
        )
    except ValueError as exc:  # the shard-count bound lives on the event
        return Decision(error=ValidationError(str(exc).splitlines()[-1], field="shard_size"))
    return Decision([event])


def dataset_info(state: ShardingState, job: str, dataset_id: str, created: bool) -> DatasetInfo:
    spec = state.job(job).datasets[dataset_id]
    return DatasetInfo(
        job=job,
        dataset_id=dataset_id,
        total_samples=spec.total_samples,
        shard_size=spec.shard_size,
        shuffle=spec.shuffle,
        seed=spec.seed,
        num_shards=spec.num_shards,
        created=created,
    )
