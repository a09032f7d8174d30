// The overview cards: the job at a glance, every figure from the dashboard state shown.

import type { ReactNode } from "react";
import type { Dashboard } from "../api/types";
import { formatAge, formatBytes, formatDurationMs, formatNumber } from "../format";
import { isLive } from "../status";

function Card(props: {
  label: string;
  value: ReactNode;
  detail?: ReactNode;
  tone?: string;
  testId: string;
}) {
  return (
    <div className={`card ${props.tone ?? ""}`} data-testid={props.testId}>
      <div className="card-label">{props.label}</div>
      <div className="card-value">{props.value}</div>
      {props.detail !== undefined && <div className="card-detail">{props.detail}</div>}
    </div>
  );
}

export function Overview(props: { state: Dashboard; replay: boolean; nowNs: number }) {
  const { state, replay, nowNs } = props;
  const { workers, datasets, checkpoints, metrics } = state;
  let live = 0;
  let failed = 0;
  let left = 0;
  let maxStep: number | null = null;
  let minStep: number | null = null;
  let maxEpoch: number | null = null;
  for (const worker of workers) {
    if (worker.status === "failed") failed += 1;
    else if (worker.status === "left") left += 1;
    if (isLive(worker.status)) {
      live += 1;
      maxStep = maxStep === null ? worker.step : Math.max(maxStep, worker.step);
      minStep = minStep === null ? worker.step : Math.min(minStep, worker.step);
      maxEpoch = maxEpoch === null ? worker.epoch : Math.max(maxEpoch, worker.epoch);
    }
  }
  const doneShards = datasets.reduce((sum, dataset) => sum + dataset.done_shards, 0);
  const allShards = datasets.reduce((sum, dataset) => sum + dataset.num_shards, 0);
  const committed = checkpoints
    .filter((checkpoint) => checkpoint.status === "committed")
    .reduce<(typeof checkpoints)[number] | null>(
      (best, checkpoint) => (best === null || checkpoint.step > best.step ? checkpoint : best),
      null,
    );
  const open = checkpoints.filter((checkpoint) => checkpoint.status === "open").length;
  // A replay carries no live rates: say so rather than show a dash.
  const rate = (value: number | null, unit: string): ReactNode =>
    value !== null ? (
      `${formatNumber(value)} ${unit}`
    ) : replay ? (
      <span className="muted">live only</span>
    ) : (
      "—"
    );

  return (
    <div className="cards span-3" data-testid="overview">
      <Card
        label="Workers live"
        testId="card-workers"
        value={
          <>
            {live}
            <span className="of"> / {workers.length}</span>
          </>
        }
        detail={`${failed} failed · ${left} left`}
        tone={failed > 0 ? "bad" : live > 0 ? "good" : ""}
      />
      <Card
        label="Step · epoch"
        testId="card-step"
        value={maxStep === null ? "—" : `${maxStep} · ${maxEpoch ?? "—"}`}
        detail={
          maxStep === null || minStep === null
            ? "no live worker"
            : `slowest live worker at step ${minStep}`
        }
      />
      <Card
        label="Datasets"
        testId="card-datasets"
        value={datasets.length}
        detail={
          allShards > 0 ? `${doneShards} / ${allShards} shards done this epoch` : "none registered"
        }
      />
      <Card
        label="Last checkpoint"
        testId="card-checkpoint"
        value={committed ? `step ${committed.step}` : "—"}
        detail={
          committed
            ? `${formatBytes(committed.bytes)} · ${formatAge(committed.committed_at, nowNs)}${
                open ? ` · ${open} open` : ""
              }`
            : open
              ? `${open} open, none committed`
              : "none committed"
        }
      />
      <Card
        label="Barrier p99"
        testId="card-barrier"
        value={formatDurationMs(metrics.barrier_p99_ms)}
        detail={`${state.barriers.length} barriers`}
      />
      <Card
        label="Checkpoint"
        testId="card-ckpt-rate"
        value={rate(metrics.checkpoint_mb_s, "MB/s")}
      />
      <Card
        label="Requests"
        testId="card-requests"
        value={rate(metrics.requests_per_s, "/s")}
        detail={replay ? undefined : `heartbeats ${formatNumber(metrics.heartbeats_per_s)} /s`}
      />
      <Card label="Events" testId="card-events" value={rate(metrics.events_per_s, "/s")} />
    </div>
  );
}
