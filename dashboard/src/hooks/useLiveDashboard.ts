// The live state of a job: the SSE push stream, with polling where the gateway has none, and the
// history of its live rates for the charts.

import { useEffect, useState } from "react";
import { ApiError, AuthRequired, api, streamDashboard } from "../api/client";
import type { Dashboard } from "../api/types";
import { type ErrorSink, isAbort, sleep } from "./common";

/** How much metric history the live charts keep. */
export const HISTORY_WINDOW_MS = 5 * 60 * 1000;
const POLL_MS = 1000;
const MAX_BACKOFF_MS = 5000;

/** One point of the live charts: the rates a live dashboard message carried, at its time. */
export interface MetricSample {
  /** Server time, ms. */
  readonly t: number;
  readonly checkpoint_mb_s: number | null;
  readonly requests_per_s: number | null;
  readonly heartbeats_per_s: number | null;
  readonly events_per_s: number | null;
  readonly barrier_p99_ms: number | null;
}

export type MetricName = Exclude<keyof MetricSample, "t">;

/**
 * Samples are placed at the time they arrived: a dashboard's `ts` is the time of the job's last
 * event, which stands still while only heartbeats and rates change.
 */
export function appendSample(history: MetricSample[], state: Dashboard, t: number): MetricSample[] {
  const last = history[history.length - 1];
  if (last && t <= last.t) return history;
  const { metrics } = state;
  const sample: MetricSample = {
    t,
    checkpoint_mb_s: metrics.checkpoint_mb_s,
    requests_per_s: metrics.requests_per_s,
    heartbeats_per_s: metrics.heartbeats_per_s,
    events_per_s: metrics.events_per_s,
    barrier_p99_ms: metrics.barrier_p99_ms,
  };
  const start = t - HISTORY_WINDOW_MS;
  let drop = 0;
  while (drop < history.length && (history[drop]?.t ?? 0) < start) drop += 1;
  return [...history.slice(drop), sample];
}

export type Connection = "connecting" | "streaming" | "polling" | "reconnecting";

export interface LiveDashboard {
  readonly state: Dashboard | null;
  readonly history: MetricSample[];
  readonly connection: Connection;
  /** Client time (ms) the last state arrived. */
  readonly receivedAt: number | null;
}

const CONNECTING: LiveDashboard = {
  state: null,
  history: [],
  connection: "connecting",
  receivedAt: null,
};

export function useLiveDashboard(
  job: string | null,
  authVersion: number,
  onError: ErrorSink,
): LiveDashboard {
  // What one connection (a job, with the token of `authVersion`) received: a change of either
  // shows a fresh, connecting view at once, derived rather than reset by the effect.
  const connection = `${job ?? ""}\u0000${authVersion}`;
  const [live, setLive] = useState<{ connection: string; view: LiveDashboard } | null>(null);

  useEffect(() => {
    if (!job) return;
    const controller = new AbortController();
    const { signal } = controller;
    const update = (change: (previous: LiveDashboard) => LiveDashboard): void =>
      setLive((previous) => {
        const current = previous?.connection === connection ? previous : null;
        const next = change(current?.view ?? CONNECTING);
        return current !== null && next === current.view ? current : { connection, view: next };
      });
    const accept = (state: Dashboard): void => {
      if (state.job !== job || signal.aborted) return;
      update((previous) => ({
        ...previous,
        state,
        history: appendSample(previous.history, state, Date.now()),
        receivedAt: Date.now(),
      }));
    };
    const setConnection = (next: Connection): void =>
      update((previous) =>
        previous.connection === next ? previous : { ...previous, connection: next },
      );

    void (async () => {
      let failures = 0;
      let streamMissing = false;
      while (!signal.aborted) {
        try {
          accept(await api.dashboard(job, signal));
          failures = 0;
          if (streamMissing) {
            setConnection("polling");
            await sleep(POLL_MS, signal);
            continue;
          }
          setConnection("streaming");
          await streamDashboard(job, accept, signal);
        } catch (error) {
          if (signal.aborted || isAbort(error)) return;
          if (error instanceof AuthRequired) {
            onError(error);
            return;
          }
          if (error instanceof ApiError && (error.status === 404 || error.status === 405)) {
            // No push endpoint on this gateway: poll instead, unless the job itself is unknown.
            if (error.message.startsWith("api/stream")) {
              streamMissing = true;
              continue;
            }
          }
          onError(error);
          failures += 1;
        }
        if (signal.aborted) return;
        setConnection("reconnecting");
        await sleep(Math.min(MAX_BACKOFF_MS, 250 * 2 ** failures), signal);
      }
    })();
    return () => controller.abort();
  }, [job, connection, onError]);

  return live !== null && live.connection === connection ? live.view : CONNECTING;
}
