// The colours of worker, checkpoint and barrier states; one place, used by the grid and legend.

import type { BarrierViewStatus, CheckpointViewStatus, WorkerViewStatus } from "./api/types";

export const WORKER_COLOURS: Readonly<Record<WorkerViewStatus, string>> = {
  idle: "#94a3b8",
  loading: "#38bdf8",
  training: "#22c55e",
  checkpointing: "#a78bfa",
  recovering: "#f59e0b",
  failed: "#ef4444",
  left: "#334155",
};

export const WORKER_MEANING: Readonly<Record<WorkerViewStatus, string>> = {
  idle: "registered, not working",
  loading: "loading data or a checkpoint",
  training: "training",
  checkpointing: "writing a checkpoint",
  recovering: "recovering after a failure",
  failed: "missed its heartbeats",
  left: "left the job",
};

export const CHECKPOINT_COLOURS: Readonly<Record<CheckpointViewStatus, string>> = {
  open: "#38bdf8",
  committed: "#22c55e",
  aborted: "#ef4444",
  pruned: "#64748b",
};

export const BARRIER_COLOURS: Readonly<Record<BarrierViewStatus, string>> = {
  waiting: "#38bdf8",
  released: "#22c55e",
  broken: "#ef4444",
  timed_out: "#f59e0b",
};

/** The colour of an event type's area, for the event log. */
export const AREA_COLOURS: Readonly<Record<string, string>> = {
  worker: "#22c55e",
  checkpoint: "#a78bfa",
  barrier: "#38bdf8",
  shard: "#f59e0b",
  dataset: "#fbbf24",
  metric: "#94a3b8",
  request: "#f87171",
};

export function areaColour(type: string): string {
  const area = type.split(".", 1)[0] ?? "";
  return AREA_COLOURS[area] ?? "#cbd5e1";
}
