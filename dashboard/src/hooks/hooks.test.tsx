// @vitest-environment jsdom
import { renderHook, waitFor } from "@testing-library/react";
import { afterEach, describe, expect, it, vi } from "vitest";
import type { Dashboard, JobSummary, RecentEvent } from "../api/types";
import { extended, joins, RECENT_EVENTS_CAP } from "./useEventIndex";
import { useJobs } from "./useJobs";
import { useReplay } from "./useReplay";
import { useTrainingMetrics } from "./useTrainingMetrics";

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

  it("hands each list it receives to onJobs", async () => {
    const jobs = [{ job: "a" }] as unknown as JobSummary[];
    gateway({ "api/jobs": () => json({ jobs }) });
    const onJobs = vi.fn();
    const { unmount } = renderHook(() => useJobs(0, vi.fn(), onJobs));
    await waitFor(() => expect(onJobs).toHaveBeenCalledWith(jobs), { timeout: WAIT_MS });
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

describe("useTrainingMetrics", () => {
  it("never shows a job the metrics of the job open before", async () => {
    gateway({
      "api/jobs/a/metrics": () => json({ job: "a" }),
      "api/jobs/b/metrics": () => json({ job: "b" }),
    });
    const onError = vi.fn();
    const { result, rerender, unmount } = renderHook(
      ({ job }: { job: string }) => useTrainingMetrics(job, 5, 0, onError),
      { initialProps: { job: "a" } },
    );
    await waitFor(() => expect(result.current).toEqual({ job: "a" }), { timeout: WAIT_MS });
    rerender({ job: "b" });
    expect(result.current).toBeNull();
    await waitFor(() => expect(result.current).toEqual({ job: "b" }), { timeout: WAIT_MS });
    expect(onError).not.toHaveBeenCalled();
    unmount();
  });
});

describe("useReplay while a new point loads", () => {
  it("keeps the state shown so far, loading, and drops it when the replay ends", async () => {
    const states: Record<string, Dashboard> = {};
    for (const seq of [3, 4]) states[seq] = { job: "a", seq } as unknown as Dashboard;
    let answer4: (() => void) | null = null;
    vi.stubGlobal("fetch", (input: string) => {
      if (input.includes("seq=3")) return Promise.resolve(json(states[3]));
      return new Promise<Response>((resolve) => {
        answer4 = () => resolve(json(states[4]));
      });
    });
    const onError = vi.fn();
    const { result, rerender, unmount } = renderHook(
      ({ seq }: { seq: number | null }) => useReplay("a", seq, 0, onError),
      { initialProps: { seq: 3 as number | null } },
    );
    expect(result.current).toEqual({ state: null, loading: true });
    await waitFor(() => expect(result.current).toEqual({ state: states[3], loading: false }), {
      timeout: WAIT_MS,
    });
    rerender({ seq: 4 });
    expect(result.current).toEqual({ state: states[3], loading: true });
    await waitFor(() => expect(answer4).not.toBeNull(), { timeout: WAIT_MS });
    answer4!();
    await waitFor(() => expect(result.current).toEqual({ state: states[4], loading: false }), {
      timeout: WAIT_MS,
    });
    rerender({ seq: null });
    expect(result.current).toEqual({ state: null, loading: false });
    expect(onError).not.toHaveBeenCalled();
    unmount();
  });
});
