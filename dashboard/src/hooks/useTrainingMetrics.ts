// The training metrics of a job, from the gateway's server-side history: fetched at once (so a
// reload shows the whole curve), then every few seconds while live; in a replay, once for the
// replayed point in time.

import { useEffect, useState } from "react";
import { AuthRequired } from "../api/client";
import { trainingMetrics } from "../api/metrics";
import type { MetricsHistoryView } from "../api/types";
import { type ErrorSink, isAbort } from "./common";

const REFRESH_MS = 2000;

export function useTrainingMetrics(
  job: string | null,
  untilNs: number | null,
  authVersion: number,
  onError: ErrorSink,
): MetricsHistoryView | null {
  // Tagged with their job: another job's metrics are never shown, with no reset to wait for.
  const [loaded, setLoaded] = useState<{ job: string; metrics: MetricsHistoryView } | null>(null);

  useEffect(() => {
    if (!job) return;
    const controller = new AbortController();
    let timer: number | undefined;
    const load = async (): Promise<void> => {
      try {
        const answer = await trainingMetrics(job, untilNs, controller.signal);
        if (!controller.signal.aborted) setLoaded({ job, metrics: answer });
      } catch (error) {
        if (controller.signal.aborted || isAbort(error)) return;
        onError(error);
        if (error instanceof AuthRequired) return;
      }
      // Live, the history grows: ask again. A replay's point in time never changes.
      if (untilNs === null && !controller.signal.aborted) {
        timer = window.setTimeout(() => void load(), REFRESH_MS);
      }
    };
    void load();
    return () => {
      controller.abort();
      window.clearTimeout(timer);
    };
  }, [job, untilNs, authVersion, onError]);

  return loaded !== null && loaded.job === job ? loaded.metrics : null;
}
