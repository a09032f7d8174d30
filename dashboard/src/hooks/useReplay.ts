// A job as it was at a stream sequence (`GET /api/replay`), debounced, cached, and asked again
// when the gateway is busy (429).

import { useEffect, useRef, useState } from "react";
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
