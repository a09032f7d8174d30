// The gateway's HTTP API, as the dashboard reads it (see docs/dashboard.md for the contract).

export const WORKER_STATUSES = [
  "idle",
  "loading",
  "training",
  "checkpointing",
  "recovering",
  "failed",
  "left",
] as const;

export type WorkerStatus = (typeof WORKER_STATUSES)[number];

export interface Worker {
  readonly id: string;
  readonly rank: number;
  readonly status: WorkerStatus;
  readonly step: number;
  readonly epoch: number;
  /** Unix time, ns; null until the first heartbeat. */
  readonly last_heartbeat: number | null;
  readonly shards: number;
  readonly hostname: string;
}

export interface Dataset {
  readonly id: string;
  readonly total_samples: number;
  readonly shard_size: number;
  readonly num_shards: number;
  readonly epoch: number | null;
  readonly plan_version: number | null;
  readonly done_shards: number;
  /** Shards of the current plan per worker id. */
  readonly loads: Readonly<Record<string, number>>;
}

export type CheckpointStatus = "open" | "committed" | "aborted" | "pruned";

export interface Checkpoint {
  readonly step: number;
  readonly epoch: number;
  readonly status: CheckpointStatus;
  readonly bytes: number;
  readonly committed_at: number | null;
  readonly duration_ms: number | null;
  readonly reason: string;
}

export type BarrierStatus = "waiting" | "released" | "broken" | "timed_out";

export interface Barrier {
  readonly name: string;
  readonly generation: number;
  readonly arrived: number;
  readonly expected: number;
  readonly status: BarrierStatus;
  readonly latency_ms: number | null;
}

export interface ShardDistributionMetric {
  readonly max_over_mean: number | null;
  readonly min: number | null;
  readonly max: number | null;
}

export interface Metrics {
  readonly checkpoint_mb_s: number | null;
  readonly requests_per_s: number | null;
  readonly heartbeats_per_s: number | null;
  readonly events_per_s: number | null;
  readonly barrier_p99_ms: number | null;
  readonly shard_distribution: ShardDistributionMetric;
}

export interface EventRef {
  readonly seq: number;
  /** Unix time, ns. */
  readonly ts: number;
  readonly type: string;
  readonly summary: string;
}

/** `GET /api/dashboard`, a `dashboard` message of `GET /api/stream`, and `GET /api/replay`. */
export interface DashboardState {
  readonly job: string;
  /** The last stream sequence folded into this state. */
  readonly seq: number;
  /** Unix time, ns. */
  readonly ts: number;
  readonly workers: readonly Worker[];
  readonly datasets: readonly Dataset[];
  readonly checkpoints: readonly Checkpoint[];
  readonly barriers: readonly Barrier[];
  readonly metrics: Metrics;
  readonly recent_events: readonly EventRef[];
}

export interface JobSummary {
  readonly job: string;
  readonly workers: number;
  readonly live: number;
  readonly last_event_ts: number;
  readonly events: number;
}

export interface JobsResponse {
  readonly jobs: readonly JobSummary[];
}

export interface EventsPage {
  readonly items: readonly (EventRef & { readonly event: unknown })[];
  readonly last_seq: number;
}
