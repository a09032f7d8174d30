// Which job the dashboard opens when the address names none.

import type { JobSummary } from "./api/types";

/** The running job (a worker holds a rank) with the newest event, else the newest job. */
export function landingJob(jobs: readonly JobSummary[]): string | null {
  let newest: JobSummary | null = null;
  let running: JobSummary | null = null;
  for (const job of jobs) {
    if (!newest || job.last_event_ts > newest.last_event_ts) newest = job;
    if (job.running && (!running || job.last_event_ts > running.last_event_ts)) running = job;
  }
  return (running ?? newest)?.job ?? null;
}
