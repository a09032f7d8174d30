// Training metrics history (`GET /api/jobs/{job}/metrics`): what workers logged with
// `log_metrics`, downsampled per bucket of steps by the gateway, per rank and for the job.

import { getJson } from "./client";
import type { MetricsHistoryView } from "./types";

/** The history of a job's training metrics; with `untilNs`, as stored by then (time travel). */
export function trainingMetrics(
  job: string,
  untilNs: number | null,
  signal?: AbortSignal,
): Promise<MetricsHistoryView> {
  const search = new URLSearchParams();
  // Nanoseconds beyond 2^53 lose their last digits as numbers: a few hundred ns, never a bucket.
  if (untilNs !== null) search.set("until_ns", BigInt(Math.floor(untilNs)).toString());
  const query = search.toString();
  return getJson<MetricsHistoryView>(
    `api/jobs/${encodeURIComponent(job)}/metrics${query ? `?${query}` : ""}`,
    signal,
  );
}
