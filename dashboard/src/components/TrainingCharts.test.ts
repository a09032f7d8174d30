import { describe, expect, it } from "vitest";
import type { LiveMarkerView, MetricView, RestartView } from "../api/types";
import { linesOf, ordered, restartSpans, stepMarkers } from "./TrainingCharts";

function marker(kind: LiveMarkerView["kind"], step: number | null): LiveMarkerView {
  return { kind, at: 1, membership_epoch: 4, step, workers: ["w1"], label: `${kind} ${step}` };
}

function restart(resumed: number | null, reached: number, ranks = [1]): RestartView {
  return { at: 1, ranks, replaced: [], step_reached: reached, resumed_step: resumed };
}

describe("training charts", () => {
  it("mark a live group's shrinks, growths and heals placed at a step, not its discards", () => {
    const shown = stepMarkers([
      marker("discard", 41),
      marker("shrink", 40),
      marker("grow", null),
      marker("heal", 77),
    ]);
    expect(shown.map((m) => [m.kind, m.step])).toEqual([
      ["shrink", 40],
      ["heal", 77],
    ]);
  });

  it("put the losses first, then the rest by name", () => {
    expect(ordered(["epoch", "train_loss", "lr", "val_loss", "accuracy"])).toEqual([
      "train_loss",
      "val_loss",
      "accuracy",
      "epoch",
      "lr",
    ]);
  });

  it("shade the steps trained again after a restart", () => {
    expect(restartSpans([restart(30, 38)])).toEqual([
      { marker: 30, retrained: [30, 38], label: "rank 1 restarted: steps 30–38 trained again" },
    ]);
  });

  it("mark a restart whose resumed step is not known yet at the step reached", () => {
    const [span] = restartSpans([restart(null, 38, [0, 1])]);
    expect(span).toEqual({
      marker: 38,
      retrained: null,
      label: "ranks 0, 1 restarted after step 38",
    });
  });

  it("shade nothing when the replacement resumed past the step reached", () => {
    expect(restartSpans([restart(40, 38)])[0]?.retrained).toBeNull();
  });
});

describe("the lines of a chart", () => {
  it("tell the processes of a restarted rank apart by worker id", () => {
    const series = (worker: string, rank: number) => ({
      worker,
      rank,
      stride: 1,
      steps: [1],
      values: [0.5],
    });
    const history: MetricView = {
      stride: 1,
      job: { steps: [1], mean: [0.5], total: [1.5] },
      workers: [series("w0", 0), series("w1", 1), series("w1-again", 1)],
    };
    expect(linesOf("loss", history).map((line) => line.label)).toEqual([
      "rank 0",
      "rank 1 (w1)",
      "rank 1 (w1-again)",
      "job mean",
    ]);
  });
});
