// Training metrics history (`GET /api/jobs/{job}/metrics`): what workers logged with
// `log_metrics`, downsampled per bucket of steps by the gateway, per rank and for the job.

import { getJson } from "./client";

/** The job's figures per bucket: mean and total over the ranks with a point in it. */
export interface JobMetricSeries {
  readonly steps: readonly number[];
  readonly mean: readonly number[];
  readonly total: readonly number[];
}

export interface WorkerMetricSeries {
  readonly worker: string;
  readonly rank: number | null;
  readonly steps: readonly number[];
  readonly values: readonly number[];
}

export interface MetricHistory {
  /** Steps per bucket: doubles as the history grows. */
  readonly stride: number;
  readonly job: JobMetricSeries;
  readonly workers: readonly WorkerMetricSeries[];
}

export interface TrainingMetrics {
  readonly job: string;
  readonly until_ns: number | null;
  readonly metrics: Readonly<Record<string, MetricHistory>>;
}

/** The history of a job's training metrics; with `untilNs`, as stored by then (time travel). */
export function trainingMetrics(
  job: string,
  untilNs: number | null,
  signal?: AbortSignal,
): Promise<TrainingMetrics> {
  const search = new URLSearchParams();
  // Nanoseconds beyond 2^53 lose their last digits as numbers: a few hundred ns, never a bucket.
  if (untilNs !== null) search.set("until_ns", BigInt(Math.floor(untilNs)).toString());
  const query = search.toString();
  return getJson<TrainingMetrics>(
    `api/jobs/${encodeURIComponent(job)}/metrics${query ? `?${query}` : ""}`,
    signal,
  );
}
