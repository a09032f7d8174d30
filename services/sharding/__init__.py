"""The sharding service: datasets, per-epoch shard plans, progress and elastic re-planning."""
