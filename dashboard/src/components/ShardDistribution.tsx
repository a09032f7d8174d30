// Shard distribution: how many shards of each dataset's current plan each worker holds. A bar per
// worker up to a few hundred workers, a histogram (workers per load) beyond.

import { memo, useMemo } from "react";
import type { DatasetView, Metrics, WorkerView } from "../api/types";
import { formatNumber } from "../format";
import { WORKER_COLOURS } from "../status";
import { Empty, Panel } from "./Panel";

const WIDTH = 360;
const HEIGHT = 110;
const BAR_LIMIT = 256;

interface Load {
  readonly id: string;
  readonly rank: number | null;
  readonly shards: number;
  readonly colour: string;
}

function stats(values: readonly number[]) {
  if (values.length === 0) return null;
  const min = Math.min(...values);
  const max = Math.max(...values);
  const mean = values.reduce((sum, value) => sum + value, 0) / values.length;
  return { min, max, mean, ratio: mean > 0 ? max / mean : null };
}

const Bars = memo(function Bars(props: { loads: readonly Load[]; max: number; mean: number }) {
  const { loads, max, mean } = props;
  const step = WIDTH / loads.length;
  const scale = (value: number): number => (max > 0 ? (value / max) * (HEIGHT - 6) : 0);
  return (
    <svg
      className="bars"
      viewBox={`0 0 ${WIDTH} ${HEIGHT}`}
      role="img"
      aria-label="shards per worker"
    >
      {loads.map((load, index) => (
        <rect
          key={load.id}
          x={index * step + (step > 3 ? 0.5 : 0)}
          y={HEIGHT - scale(load.shards)}
          width={Math.max(step - (step > 3 ? 1 : 0), 0.5)}
          height={scale(load.shards)}
          fill={load.colour}
        >
          <title>{`${load.rank === null ? "" : `rank ${load.rank} `}${load.id}: ${load.shards} shards`}</title>
        </rect>
      ))}
      <line className="mean" x1={0} x2={WIDTH} y1={HEIGHT - scale(mean)} y2={HEIGHT - scale(mean)}>
        <title>{`mean ${formatNumber(mean)}`}</title>
      </line>
    </svg>
  );
});

const Histogram = memo(function Histogram(props: { loads: readonly Load[] }) {
  const buckets = useMemo(() => {
    const counts = new Map<number, number>();
    for (const load of props.loads) counts.set(load.shards, (counts.get(load.shards) ?? 0) + 1);
    return [...counts.entries()].sort((a, b) => a[0] - b[0]);
  }, [props.loads]);
  const most = Math.max(1, ...buckets.map(([, count]) => count));
  const step = WIDTH / Math.max(1, buckets.length);
  return (
    <svg
      className="bars"
      viewBox={`0 0 ${WIDTH} ${HEIGHT + 14}`}
      role="img"
      aria-label="workers per shard count"
    >
      {buckets.map(([shards, count], index) => {
        const height = (count / most) * (HEIGHT - 6);
        return (
          <g key={shards}>
            <rect
              x={index * step + 1}
              y={HEIGHT - height}
              width={Math.max(step - 2, 1)}
              height={height}
              fill="#38bdf8"
            >
              <title>{`${count} workers hold ${shards} shards`}</title>
            </rect>
            {buckets.length <= 24 && (
              <text
                className="axis"
                x={index * step + step / 2}
                y={HEIGHT + 11}
                textAnchor="middle"
              >
                {shards}
              </text>
            )}
          </g>
        );
      })}
    </svg>
  );
});

function DatasetLoads(props: { dataset: DatasetView; workers: ReadonlyMap<string, WorkerView> }) {
  const { dataset, workers } = props;
  const loads = useMemo<Load[]>(
    () =>
      Object.entries(dataset.loads)
        .map(([id, shards]) => {
          const worker = workers.get(id);
          return {
            id,
            shards,
            rank: worker ? worker.rank : null,
            colour: worker ? WORKER_COLOURS[worker.status] : "#64748b",
          };
        })
        .sort((a, b) => (a.rank ?? Infinity) - (b.rank ?? Infinity) || a.id.localeCompare(b.id)),
    [dataset.loads, workers],
  );
  const summary = stats(loads.map((load) => load.shards));
  const progress = dataset.num_shards > 0 ? dataset.done_shards / dataset.num_shards : 0;
  return (
    <div className="dataset" data-testid={`dataset-${dataset.id}`}>
      <div className="dataset-head">
        <strong>{dataset.id}</strong>
        <span className="muted">
          epoch {dataset.epoch ?? "—"} · plan v{dataset.plan_version ?? "—"} · {dataset.num_shards}{" "}
          shards of {formatNumber(dataset.shard_size)} · {formatNumber(dataset.total_samples)}{" "}
          samples
        </span>
      </div>
      <div
        className="progress"
        title={`${dataset.done_shards} of ${dataset.num_shards} shards done`}
      >
        <div className="progress-fill" style={{ width: `${(progress * 100).toFixed(1)}%` }} />
        <span>
          {dataset.done_shards} / {dataset.num_shards} done
        </span>
      </div>
      {summary === null ? (
        <Empty>No plan yet: no live worker holds shards of it.</Empty>
      ) : (
        <>
          {loads.length <= BAR_LIMIT ? (
            <Bars loads={loads} max={summary.max} mean={summary.mean} />
          ) : (
            <Histogram loads={loads} />
          )}
          <p className="chart-note">
            {loads.length} workers · min {summary.min} · mean {formatNumber(summary.mean)} · max{" "}
            {summary.max} · max/mean {formatNumber(summary.ratio)}
            {loads.length > BAR_LIMIT ? " · histogram: workers per shard count" : " · bars by rank"}
          </p>
        </>
      )}
    </div>
  );
}

export function ShardDistribution(props: {
  datasets: readonly DatasetView[];
  workers: readonly WorkerView[];
  metrics: Metrics;
}) {
  const byId = useMemo(
    () => new Map(props.workers.map((worker) => [worker.id, worker])),
    [props.workers],
  );
  const job = props.metrics.shard_distribution;
  return (
    <Panel
      title="Shard distribution"
      subtitle={
        job.max_over_mean === null
          ? undefined
          : `job max/mean ${formatNumber(job.max_over_mean)} (min ${job.min ?? "—"}, max ${job.max ?? "—"})`
      }
      testId="shards"
    >
      {props.datasets.length === 0 ? (
        <Empty>No dataset registered in this job.</Empty>
      ) : (
        props.datasets.map((dataset) => (
          <DatasetLoads key={dataset.id} dataset={dataset} workers={byId} />
        ))
      )}
    </Panel>
  );
}
