// The index of a job's events (for the time-travel slider and the event log): the seq, time,
// type and summary of every event, read from `/api/jobs/{job}/events` at first and whenever the
// live state's recent events leave a gap, otherwise extended from the live state's
// `recent_events`.

import { useCallback, useEffect, useRef, useState } from "react";
import { api } from "../api/client";
import type { Dashboard, RecentEvent } from "../api/types";
import { type ErrorSink, isAbort } from "./common";

const EVENTS_PAGE = 1000;
/** The gateway's `recent_events` holds the last 200 events of the job. */
export const RECENT_EVENTS_CAP = 200;
const INDEX_RETRY_MS = 3000;

export interface EventIndex {
  /** This job's events in stream order: a new array whenever events are added. */
  readonly entries: readonly RecentEvent[];
  /** The whole history up to the live state is known. */
  readonly complete: boolean;
}

const EMPTY: EventIndex = { entries: [], complete: false };

/** `entries` with the items past its last sequence added, or `entries` itself when none is. */
export function extended(
  entries: readonly RecentEvent[],
  items: readonly RecentEvent[],
): readonly RecentEvent[] {
  let last = entries[entries.length - 1]?.seq ?? 0;
  const added: RecentEvent[] = [];
  for (const item of items) {
    if (item.seq > last) {
      added.push({ seq: item.seq, ts: item.ts, type: item.type, summary: item.summary });
      last = item.seq;
    }
  }
  return added.length === 0 ? entries : [...entries, ...added];
}

/**
 * Whether the live state's recent events join an index ending at `cursor` without a gap: they
 * start at or before its end, or there are fewer than their cap (all the job has).
 */
export function joins(recent: readonly RecentEvent[], cursor: number): boolean {
  const first = recent[0];
  return !first || first.seq <= cursor + 1 || recent.length < RECENT_EVENTS_CAP;
}

export function useEventIndex(
  job: string | null,
  live: Dashboard | null,
  authVersion: number,
  onError: ErrorSink,
): EventIndex {
  const [index, setIndex] = useState<EventIndex>(EMPTY);
  // The newest index, read by the page loop between renders (it runs across many of them).
  const current = useRef<readonly RecentEvent[]>([]);
  const loaded = useRef(false);
  const fetching = useRef<AbortController | null>(null);
  const latest = useRef<Dashboard | null>(null);
  const retryAt = useRef(0);

  const append = useCallback((items: readonly RecentEvent[], complete: boolean): void => {
    const next = extended(current.current, items);
    current.current = next;
    setIndex((previous) =>
      previous.entries === next && previous.complete === complete
        ? previous
        : { entries: next, complete },
    );
  }, []);

  const sync = useCallback(
    (currentJob: string, justFetched = false) => {
      const state = latest.current;
      if (fetching.current || !state || state.job !== currentJob) return;
      if (Date.now() < retryAt.current) return;
      const recent = [...state.recent_events].sort((a, b) => a.seq - b.seq);
      const cursor = current.current[current.current.length - 1]?.seq ?? 0;
      // Right after reading the pages, the tail is taken as it is: asking again would only
      // return the same pages.
      if (loaded.current && (joins(recent, cursor) || justFetched)) {
        append(recent, true);
        return;
      }
      const controller = new AbortController();
      fetching.current = controller;
      append([], false);
      void (async () => {
        try {
          // `last_seq` is the last stream sequence the gateway examined (other jobs' events
          // included): the next page starts after it; it stops moving at the stream's end.
          let scanned = cursor;
          for (;;) {
            const page = await api.events(
              currentJob,
              { afterSeq: scanned, limit: EVENTS_PAGE },
              controller.signal,
            );
            if (controller.signal.aborted) return; // another job (or token) since
            append(page.items, false);
            const end = current.current[current.current.length - 1]?.seq ?? 0;
            const next = Math.max(page.last_seq, end);
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

  // Another job (or token) starts an empty index at once: adjusted while rendering, as React
  // advises for state that follows a prop; the effect below starts over the page loop's refs.
  const session = `${job ?? ""}\u0000${authVersion}`;
  const [indexed, setIndexed] = useState(session);
  if (session !== indexed) {
    setIndexed(session);
    setIndex(EMPTY);
  }

  useEffect(() => {
    current.current = [];
    loaded.current = false;
    latest.current = null;
    retryAt.current = 0;
    fetching.current?.abort();
    fetching.current = null;
  }, [session]);

  useEffect(() => {
    if (!job || !live || live.job !== job) return;
    latest.current = live;
    sync(job);
  }, [job, live, sync]);

  useEffect(() => () => fetching.current?.abort(), []);

  return index;
}
