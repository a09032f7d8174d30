// @vitest-environment jsdom
import { renderHook, waitFor } from "@testing-library/react";
import { afterEach, describe, expect, it, vi } from "vitest";
import type { Dashboard, JobSummary, RecentEvent } from "../api/types";
import { extended, joins, RECENT_EVENTS_CAP } from "./useEventIndex";
import { useJobs } from "./useJobs";
import { useReplay } from "./useReplay";

/** Generous: the tests run beside others on a loaded machine. */
const WAIT_MS = 10_000;

function event(seq: number): RecentEvent {
  return { seq, ts: seq * 1000, type: "worker.registered", summary: `event ${seq}` };
}

/** A gateway answering each path with the JSON of the first matching route. */
function gateway(routes: Record<string, (url: string) => Response>): string[] {
  const asked: string[] = [];
  vi.stubGlobal("fetch", (input: string) => {
    asked.push(input);
    for (const [prefix, answer] of Object.entries(routes)) {
      if (input.startsWith(prefix)) return Promise.resolve(answer(input));
    }
    return Promise.resolve(new Response("{}", { status: 404 }));
  });
  return asked;
}

function json(body: unknown, status = 200, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), {
    status,
    headers: { "Content-Type": "application/json", ...headers },
  });
}

afterEach(() => {
  vi.unstubAllGlobals();
});

describe("the event index", () => {
  it("adds only events past its end, and keeps its array when none is", () => {
    const start = [event(1), event(2)];
    const grown = extended(start, [event(2), event(3), event(4)]);
    expect(grown.map((e) => e.seq)).toEqual([1, 2, 3, 4]);
    expect(start).toHaveLength(2); // a new array: the old one is left as it was
    expect(extended(grown, [event(3)])).toBe(grown);
  });

  it("joins the live tail without a gap, or when the tail is all the job has", () => {
    expect(joins([event(5), event(6)], 4)).toBe(true);
    const full = Array.from({ length: RECENT_EVENTS_CAP }, (_, i) => event(i + 10));
    expect(joins(full, 4)).toBe(false);
    expect(joins(full, 9)).toBe(true);
    expect(joins([], 0)).toBe(true);
  });
});

describe("useJobs", () => {
  it("gives the gateway's job list", async () => {
    const jobs: JobSummary[] = [
      {
        job: "a",
        workers: 2,
        live: 2,
        running: true,
        ranks_lost: 1,
        restarts: 1,
        last_event_ts: 5,
        events: 9,
      },
    ];
    gateway({ "api/jobs": () => json({ jobs }) });
    const onError = vi.fn();
    const { result, unmount } = renderHook(() => useJobs(0, onError));
    expect(result.current).toBeNull();
    await waitFor(() => expect(result.current).toEqual(jobs), { timeout: WAIT_MS });
    expect(onError).not.toHaveBeenCalled();
    unmount();
  });

  it("reports an error it cannot recover from", async () => {
    gateway({ "api/jobs": () => json({ detail: "down" }, 503) });
    const onError = vi.fn();
    const { unmount } = renderHook(() => useJobs(0, onError));
    await waitFor(() => expect(onError).toHaveBeenCalled(), { timeout: WAIT_MS });
    unmount();
  });
});

describe("useReplay", () => {
  it("is empty without a sequence, and the replayed state with one, asked again when busy", async () => {
    const state = { job: "a", seq: 7 } as unknown as Dashboard;
    let busy = 1;
    const asked = gateway({
      "api/replay": () =>
        busy-- > 0 ? json({ detail: "busy" }, 429, { "Retry-After": "0" }) : json(state),
    });
    const onError = vi.fn();
    const { result, rerender, unmount } = renderHook(
      ({ seq }: { seq: number | null }) => useReplay("a", seq, 0, onError),
      { initialProps: { seq: null as number | null } },
    );
    expect(result.current).toEqual({ state: null, loading: false });
    rerender({ seq: 7 });
    await waitFor(() => expect(result.current).toEqual({ state, loading: false }), {
      timeout: WAIT_MS,
    });
    expect(asked.filter((url) => url.includes("seq=7"))).toHaveLength(2);
    expect(onError).not.toHaveBeenCalled();

    // A sequence seen before comes from the cache: no new request.
    rerender({ seq: null });
    rerender({ seq: 7 });
    expect(result.current).toEqual({ state, loading: false });
    expect(asked.filter((url) => url.includes("seq=7"))).toHaveLength(2);
    unmount();
  });
});
