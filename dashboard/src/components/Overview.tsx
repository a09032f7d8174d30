// The overview cards: the job at a glance, every figure from the dashboard state shown.

import type { ReactNode } from "react";
import type { Dashboard, LossView, RestartView } from "../api/types";
import { formatAge, formatBytes, formatDurationMs, formatNumber } from "../format";

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

/** "rank 1 lost at step 38, 12 s ago; restarted 3 s ago, resumed at step 30" */
export function describeRestart(
  restart: RestartView | undefined,
  loss: LossView | undefined,
  nowNs: number,
): string {
  if (!restart && !loss) return "no rank lost";
  const lost = loss
    ? `rank ${loss.rank} lost at step ${loss.step}, ${formatAge(loss.at, nowNs)}`
    : "";
  if (!restart || (loss && loss.at > restart.at)) return lost;
  const ranks = restart.ranks.length === 1 ? "rank" : "ranks";
  const resumed =
    restart.resumed_step === null ? "" : `, resumed at step ${restart.resumed_step}`;
  const restarted = `${ranks} ${restart.ranks.join(", ")} restarted ${formatAge(restart.at, nowNs)}${resumed}`;
  return lost ? `${lost}; ${restarted}` : restarted;
}

export function Overview(props: { state: Dashboard; replay: boolean; nowNs: number }) {
  const { state, replay, nowNs } = props;
  const { figures, metrics } = state;
  const lastLoss = state.losses[state.losses.length - 1];
  const lastRestart = state.restarts[state.restarts.length - 1];
  const committed = state.checkpoints.find(
    (checkpoint) => checkpoint.step === figures.last_committed_step && checkpoint.status === "committed",
  );
  const open = figures.open_checkpoints;
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
            {figures.live}
            <span className="of"> / {figures.workers}</span>
          </>
        }
        detail={`${figures.failed} failed · ${figures.left} left`}
        tone={figures.failed > 0 ? "bad" : figures.live > 0 ? "good" : ""}
      />
      <Card
        label="Restarts"
        testId="card-restarts"
        value={
          <>
            {figures.restarts}
            <span className="of">
              {" "}
              · {figures.ranks_lost} {figures.ranks_lost === 1 ? "rank" : "ranks"} lost
            </span>
          </>
        }
        detail={describeRestart(lastRestart, lastLoss, nowNs)}
        tone={figures.ranks_lost > 0 ? "warn" : ""}
      />
      <Card
        label="Step · epoch"
        testId="card-step"
        value={figures.max_step === null ? "—" : `${figures.max_step} · ${figures.max_epoch ?? "—"}`}
        detail={
          figures.min_step === null
            ? "no live worker"
            : `slowest live worker at step ${figures.min_step}`
        }
      />
      <Card
        label="Datasets"
        testId="card-datasets"
        value={state.datasets.length}
        detail={
          figures.total_shards > 0
            ? `${figures.done_shards} / ${figures.total_shards} shards done this epoch`
            : "none registered"
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
