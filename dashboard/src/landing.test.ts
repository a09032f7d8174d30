import { describe, expect, it } from "vitest";
import type { JobSummary } from "./api/types";
import { landingJob } from "./landing";

function job(name: string, lastEventTs: number, running: boolean): JobSummary {
  return {
    job: name,
    workers: 2,
    live: running ? 2 : 0,
    running,
    ranks_lost: 0,
    restarts: 0,
    last_event_ts: lastEventTs,
    events: 10,
  };
}

describe("the landing job", () => {
  it("is the newest running job, even when a stopped one is newer", () => {
    const jobs = [job("old-running", 1, true), job("crashed", 9, false), job("running", 5, true)];
    expect(landingJob(jobs)).toBe("running");
  });

  it("is the newest job when none is running", () => {
    expect(landingJob([job("a", 3, false), job("b", 7, false)])).toBe("b");
  });

  it("is none without jobs", () => {
    expect(landingJob([])).toBeNull();
  });
});
