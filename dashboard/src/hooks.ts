// Data hooks: the job list, the live state (SSE with a polling fallback) and its metric history,
// the index of a job's events (for the time-travel slider and the event log), and replays.

import { useCallback, useEffect, useRef, useState } from "react";
import { ApiError, AuthRequired, api, streamDashboard } from "./api/client";
import type { Dashboard, RecentEvent, JobSummary } from "./api/types";

/** How much metric history the live charts keep. */
export const HISTORY_WINDOW_MS = 5 * 60 * 1000;
const POLL_MS = 1000;
const JOBS_REFRESH_MS = 5000;
const EVENTS_PAGE = 1000;
/** The gateway's `recent_events` holds the last 200 events of the job. */
const RECENT_EVENTS_CAP = 200;
const INDEX_RETRY_MS = 3000;
const MAX_BACKOFF_MS = 5000;

export type ErrorSink = (error: unknown) => void;

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = window.setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      window.clearTimeout(timer);
      resolve();
    });
  });
}

function isAbort(error: unknown): boolean {
  return error instanceof DOMException && error.name === "AbortError";
}

export function useJobs(authVersion: number, onError: ErrorSink): JobSummary[] | null {
  const [jobs, setJobs] = useState<JobSummary[] | null>(null);
  useEffect(() => {
    const controller = new AbortController();
    void (async () => {
      while (!controller.signal.aborted) {
        try {
          const answer = await api.jobs(controller.signal);
          setJobs([...answer.jobs]);
        } catch (error) {
          if (isAbort(error)) return;
          onError(error);
          if (error instanceof AuthRequired) return;
        }
        await sleep(JOBS_REFRESH_MS, controller.signal);
      }
    })();
    return () => controller.abort();
  }, [authVersion, onError]);
  return jobs;
}

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
function appendSample(history: MetricSample[], state: Dashboard, t: number): MetricSample[] {
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

export function useLiveDashboard(
  job: string | null,
  authVersion: number,
  onError: ErrorSink,
): LiveDashboard {
  const [live, setLive] = useState<LiveDashboard>({
    state: null,
    history: [],
    connection: "connecting",
    receivedAt: null,
  });

  useEffect(() => {
    setLive({ state: null, history: [], connection: "connecting", receivedAt: null });
    if (!job) return;
    const controller = new AbortController();
    const { signal } = controller;
    const accept = (state: Dashboard): void => {
      if (state.job !== job || signal.aborted) return;
      setLive((previous) => ({
        ...previous,
        state,
        history: appendSample(previous.history, state, Date.now()),
        receivedAt: Date.now(),
      }));
    };
    const setConnection = (connection: Connection): void =>
      setLive((previous) =>
        previous.connection === connection ? previous : { ...previous, connection },
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
  }, [job, authVersion, onError]);

  return live;
}

export interface EventIndex {
  /** This job's events in stream order; the array grows in place, `version` says when. */
  readonly entries: readonly RecentEvent[];
  readonly version: number;
  /** The whole history up to the live state is known. */
  readonly complete: boolean;
}

/**
 * The seq, time, type and summary of every event of a job: fetched from
 * `/api/jobs/{job}/events` at first and whenever the live state's recent events leave a gap,
 * otherwise extended from the live state's `recent_events`.
 */
export function useEventIndex(
  job: string | null,
  live: Dashboard | null,
  authVersion: number,
  onError: ErrorSink,
): EventIndex {
  const entries = useRef<RecentEvent[]>([]);
  const cursor = useRef(0);
  const loaded = useRef(false);
  const fetching = useRef<AbortController | null>(null);
  const latest = useRef<Dashboard | null>(null);
  const retryAt = useRef(0);
  const [version, setVersion] = useState(0);
  const [complete, setComplete] = useState(false);

  const append = useCallback((items: readonly RecentEvent[]): boolean => {
    let added = false;
    for (const item of items) {
      if (item.seq > cursor.current) {
        entries.current.push({
          seq: item.seq,
          ts: item.ts,
          type: item.type,
          summary: item.summary,
        });
        cursor.current = item.seq;
        added = true;
      }
    }
    return added;
  }, []);

  const sync = useCallback(
    (currentJob: string, justFetched = false) => {
      const state = latest.current;
      if (fetching.current || !state || state.job !== currentJob) return;
      if (Date.now() < retryAt.current) return;
      const recent = [...state.recent_events].sort((a, b) => a.seq - b.seq);
      const first = recent[0];
      // recent_events is the tail of the job's events: it joins the index without a gap when it
      // starts at or before the index's end, or when it is shorter than its cap (all there is).
      const joins = !first || first.seq <= cursor.current + 1 || recent.length < RECENT_EVENTS_CAP;
      // Right after reading the pages, the tail is taken as it is: asking again would only
      // return the same pages.
      if (loaded.current && (joins || justFetched)) {
        if (append(recent)) setVersion((value) => value + 1);
        setComplete(true);
        return;
      }
      const controller = new AbortController();
      fetching.current = controller;
      setComplete(false);
      void (async () => {
        try {
          // `last_seq` is the last stream sequence the gateway examined (other jobs' events
          // included): the next page starts after it; it stops moving at the stream's end.
          let scanned = cursor.current;
          for (;;) {
            const page = await api.events(
              currentJob,
              { afterSeq: scanned, limit: EVENTS_PAGE },
              controller.signal,
            );
            if (controller.signal.aborted) return; // another job (or token) since
            if (append(page.items)) setVersion((value) => value + 1);
            const next = Math.max(page.last_seq, cursor.current);
            if (next <= scanned) break;
            scanned = next;
          }
          loaded.current = true;
        } catch (error) {
          if (!controller.signal.aborted && !isAbort(error)) {
            retryAt.current = Date.now() + INDEX_RETRY_MS;
            onError(error);
          }
          return;
        } finally {
          if (fetching.current === controller) fetching.current = null;
        }
        // Events may have arrived live while the pages were read.
        sync(currentJob, true);
      })();
    },
    [append, onError],
  );

  useEffect(() => {
    entries.current = [];
    cursor.current = 0;
    loaded.current = false;
    latest.current = null;
    retryAt.current = 0;
    fetching.current?.abort();
    fetching.current = null;
    setComplete(false);
    setVersion((value) => value + 1);
  }, [job, authVersion]);

  useEffect(() => {
    if (!job || !live || live.job !== job) return;
    latest.current = live;
    sync(job);
  }, [job, live, sync]);

  useEffect(() => () => fetching.current?.abort(), []);

  return { entries: entries.current, version, complete };
}

export interface Replay {
  readonly state: Dashboard | null;
  readonly loading: boolean;
}

const REPLAY_DEBOUNCE_MS = 80;
const REPLAY_CACHE = 64;
/** A slider dragged fast starts replays faster than the gateway runs them (it runs a few at
 * once and answers 429 past that): ask again after a pause this long at most. */
const REPLAY_BUSY_RETRY_MAX_MS = 1000;

function pause(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = window.setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      window.clearTimeout(timer);
      resolve();
    });
  });
}

async function replayWhenFree(
  job: string,
  seq: number,
  signal: AbortSignal,
): Promise<Dashboard> {
  for (;;) {
    try {
      return await api.replay(job, seq, signal);
    } catch (error) {
      if (!(error instanceof ApiError) || error.status !== 429 || signal.aborted) throw error;
      await pause(Math.min((error.retryAfterS ?? 1) * 1000, REPLAY_BUSY_RETRY_MAX_MS), signal);
      if (signal.aborted) throw error;
    }
  }
}

/** The job as it was at stream sequence `seq` (`GET /api/replay`); null seq means no replay. */
export function useReplay(
  job: string | null,
  seq: number | null,
  authVersion: number,
  onError: ErrorSink,
): Replay {
  const cache = useRef(new Map<string, Dashboard>());
  const [replay, setReplay] = useState<Replay>({ state: null, loading: false });

  useEffect(() => {
    if (!job || seq === null) {
      setReplay({ state: null, loading: false });
      return;
    }
    const key = `${job}\u0000${seq}`;
    const cached = cache.current.get(key);
    if (cached) {
      setReplay({ state: cached, loading: false });
      return;
    }
    setReplay((previous) => ({ state: previous.state, loading: true }));
    const controller = new AbortController();
    const timer = window.setTimeout(() => {
      void (async () => {
        try {
          const state = await replayWhenFree(job, seq, controller.signal);
          cache.current.set(key, state);
          if (cache.current.size > REPLAY_CACHE) {
            const oldest = cache.current.keys().next().value;
            if (oldest !== undefined) cache.current.delete(oldest);
          }
          setReplay({ state, loading: false });
        } catch (error) {
          if (controller.signal.aborted || isAbort(error)) return;
          onError(error);
          setReplay((previous) => ({ state: previous.state, loading: false }));
        }
      })();
    }, REPLAY_DEBOUNCE_MS);
    return () => {
      window.clearTimeout(timer);
      controller.abort();
    };
  }, [job, seq, authVersion, onError]);

  return replay;
}
