// The job list (`GET /api/jobs`), asked again every few seconds.

import { useEffect, useState } from "react";
import { AuthRequired, api } from "../api/client";
import type { JobSummary } from "../api/types";
import { type ErrorSink, isAbort, sleep } from "./common";

export const JOBS_REFRESH_MS = 5000;

/** The job list; `onJobs` hears each list as it arrives (a stable callback, like `onError`). */
export function useJobs(
  authVersion: number,
  onError: ErrorSink,
  onJobs?: (jobs: readonly JobSummary[]) => void,
): JobSummary[] | null {
  const [jobs, setJobs] = useState<JobSummary[] | null>(null);
  useEffect(() => {
    const controller = new AbortController();
    void (async () => {
      while (!controller.signal.aborted) {
        try {
          const answer = await api.jobs(controller.signal);
          setJobs([...answer.jobs]);
          onJobs?.(answer.jobs);
        } catch (error) {
          if (isAbort(error)) return;
          onError(error);
          if (error instanceof AuthRequired) return;
        }
        await sleep(JOBS_REFRESH_MS, controller.signal);
      }
    })();
    return () => controller.abort();
  }, [authVersion, onError, onJobs]);
  return jobs;
}
