import { describe, expect, it } from "vitest";
import type { LossView, RestartView } from "../api/types";
import { describeRestart } from "./Overview";

const SECOND = 1_000_000_000;
const NOW = 1_800_000_000 * SECOND;
const loss: LossView = { rank: 1, worker: "w1", status: "failed", at: NOW - 12 * SECOND, step: 38 };

describe("the restarts card", () => {
  it("says when nothing was lost", () => {
    expect(describeRestart(undefined, undefined, NOW)).toBe("no rank lost");
  });

  it("names a lost rank not replaced yet", () => {
    expect(describeRestart(undefined, loss, NOW)).toBe("rank 1 lost at step 38, 12 s ago");
  });

  it("names the loss and the restart that followed it", () => {
    const restart: RestartView = {
      at: NOW - 3 * SECOND,
      ranks: [1],
      replaced: [loss],
      step_reached: 38,
      resumed_step: 30,
    };
    expect(describeRestart(restart, loss, NOW)).toBe(
      "rank 1 lost at step 38, 12 s ago; rank 1 restarted 3 s ago, resumed at step 30",
    );
  });
});
