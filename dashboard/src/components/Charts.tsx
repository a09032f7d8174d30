// The live charts: the rates of the live dashboard messages kept over the last minutes
// (client-side), plus the throughput of each committed checkpoint as dots.

import { useMemo } from "react";
import type { CheckpointView } from "../api/types";
import { formatNumber, nsToMs } from "../format";
import { HISTORY_WINDOW_MS } from "../hooks/useLiveDashboard";
import type { MetricName, MetricSample } from "../hooks/useLiveDashboard";
import { Panel } from "./Panel";

const MIN_WINDOW_MS = 60 * 1000;
import { TimeChart } from "./TimeChart";
import type { Dot, Series } from "./TimeChart";

function seriesOf(
  history: readonly MetricSample[],
  name: MetricName,
  label: string,
  colour: string,
): Series {
  return { label, colour, points: history.map((sample) => [sample.t, sample[name]] as const) };
}

function latestOf(series: Series): number | null {
  const last = series.points[series.points.length - 1];
  return last ? last[1] : null;
}

function Legend(props: { series: readonly Series[]; unit: string }) {
  return (
    <ul className="chart-legend">
      {props.series.map((line) => (
        <li key={line.label}>
          <span className="swatch line" style={{ backgroundColor: line.colour }} />
          {line.label} <strong>{formatNumber(latestOf(line))}</strong> {props.unit}
        </li>
      ))}
    </ul>
  );
}

export function Charts(props: {
  history: readonly MetricSample[];
  checkpoints: readonly CheckpointView[];
  replayMs: number | null;
}) {
  const { history, checkpoints, replayMs } = props;
  const endMs = history[history.length - 1]?.t ?? 0;

  const throughput = useMemo(
    () => [seriesOf(history, "checkpoint_mb_s", "checkpoint", "#a78bfa")],
    [history],
  );
  const rates = useMemo(
    () => [
      seriesOf(history, "requests_per_s", "requests", "#38bdf8"),
      seriesOf(history, "events_per_s", "events", "#fbbf24"),
      seriesOf(history, "heartbeats_per_s", "heartbeats", "#64748b"),
    ],
    [history],
  );
  const latency = useMemo(
    () => [seriesOf(history, "barrier_p99_ms", "barrier p99", "#22c55e")],
    [history],
  );
  const checkpointDots = useMemo<Dot[]>(
    () =>
      checkpoints.flatMap((checkpoint) =>
        checkpoint.committed_at !== null && checkpoint.duration_ms && checkpoint.duration_ms > 0
          ? [
              {
                t: nsToMs(checkpoint.committed_at),
                value: checkpoint.bytes / 1e6 / (checkpoint.duration_ms / 1000),
                label: `step ${checkpoint.step}: ${formatNumber(
                  checkpoint.bytes / 1e6 / (checkpoint.duration_ms / 1000),
                )} MB/s`,
              },
            ]
          : [],
      ),
    [checkpoints],
  );

  // The time axis grows with the history, from one minute up to the whole window kept.
  const spanMs = endMs - (history[0]?.t ?? endMs);
  const windowMs = Math.min(
    HISTORY_WINDOW_MS,
    Math.max(MIN_WINDOW_MS, Math.ceil(spanMs / MIN_WINDOW_MS) * MIN_WINDOW_MS),
  );
  const samples = history.length;
  const subtitle =
    samples < 2
      ? "collecting: the charts fill as live updates arrive"
      : `last ${windowMs / 60000} min, ${samples} live samples since this page opened`;
  const common = { windowMs, endMs, markerMs: replayMs };
  return (
    <Panel title="Live rates" subtitle={subtitle} className="span-3 charts" testId="charts">
      <div className="chart-row">
        <figure>
          <figcaption>Checkpoint throughput</figcaption>
          <TimeChart
            series={throughput}
            dots={checkpointDots}
            dotColour="#e9d5ff"
            unit="MB/s"
            testId="chart-checkpoint"
            {...common}
          />
          <Legend series={throughput} unit="MB/s" />
          <p className="chart-note">dots: committed checkpoints (size ÷ commit time)</p>
        </figure>
        <figure>
          <figcaption>Request rate</figcaption>
          <TimeChart series={rates} unit="per s" testId="chart-requests" {...common} />
          <Legend series={rates} unit="/s" />
        </figure>
        <figure>
          <figcaption>Barrier latency</figcaption>
          <TimeChart series={latency} unit="ms" testId="chart-barrier" {...common} />
          <Legend series={latency} unit="ms" />
        </figure>
      </div>
    </Panel>
  );
}
