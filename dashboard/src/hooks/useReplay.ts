// A job as it was at a stream sequence (`GET /api/replay`), debounced, cached, and asked again
// when the gateway is busy (429).

import { useEffect, useState } from "react";
import { ApiError, api } from "../api/client";
import type { Dashboard } from "../api/types";
import { type ErrorSink, isAbort, sleep } from "./common";

export interface Replay {
  readonly state: Dashboard | null;
  readonly loading: boolean;
}

const REPLAY_DEBOUNCE_MS = 80;
const REPLAY_CACHE = 64;
/** A slider dragged fast starts replays faster than the gateway runs them (it runs a few at
 * once and answers 429 past that): ask again after a pause this long at most. */
const REPLAY_BUSY_RETRY_MAX_MS = 1000;

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
      await sleep(Math.min((error.retryAfterS ?? 1) * 1000, REPLAY_BUSY_RETRY_MAX_MS), signal);
      if (signal.aborted) throw error;
    }
  }
}

const NO_REPLAY: Replay = { state: null, loading: false };

/** `cache` with `state` added under `key`, the oldest entry left out past REPLAY_CACHE. */
function cached(
  cache: ReadonlyMap<string, Dashboard>,
  key: string,
  state: Dashboard,
): ReadonlyMap<string, Dashboard> {
  const next = new Map(cache);
  next.set(key, state);
  if (next.size > REPLAY_CACHE) {
    const oldest = next.keys().next().value;
    if (oldest !== undefined) next.delete(oldest);
  }
  return next;
}

/** The job as it was at stream sequence `seq` (`GET /api/replay`); null seq means no replay. */
export function useReplay(
  job: string | null,
  seq: number | null,
  authVersion: number,
  onError: ErrorSink,
): Replay {
  const [cache, setCache] = useState<ReadonlyMap<string, Dashboard>>(() => new Map());
  const key = job && seq !== null ? `${job}\u0000${seq}` : null;
  const [replay, setReplay] = useState<Replay>(
    key === null ? NO_REPLAY : { state: null, loading: true },
  );

  // A new point in time (or token) shows at once: the cached state, or the one shown so far
  // while the new one loads. Adjusted while rendering, as React advises for state that follows
  // a prop, rather than by an effect's second render.
  const request = `${key ?? ""}\u0000${authVersion}`;
  const [requested, setRequested] = useState(request);
  if (request !== requested) {
    setRequested(request);
    const hit = key === null ? undefined : cache.get(key);
    setReplay(key === null ? NO_REPLAY : { state: hit ?? replay.state, loading: hit === undefined });
  }

  useEffect(() => {
    if (!job || seq === null || key === null || cache.has(key)) return;
    const controller = new AbortController();
    const timer = window.setTimeout(() => {
      void (async () => {
        try {
          const state = await replayWhenFree(job, seq, controller.signal);
          setCache((previous) => cached(previous, key, state));
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
  }, [job, seq, key, cache, authVersion, onError]);

  return replay;
}
