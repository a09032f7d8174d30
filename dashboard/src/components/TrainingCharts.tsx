// Training metrics (what workers logged with `log_metrics`): one chart per metric against the
// training step, a line per rank and the job's line on top: the mean over ranks (a loss), or
// their total for a rate (names ending in `_per_s`, which add up across ranks). A restart is a
// dashed marker at the step its replacements resumed from, with the steps trained twice shaded
// up to the step the lost processes had reached. A live group's shrinks, growths and heals are
// dotted markers at the steps the read model placed them (`live.markers`).

import { memo, useMemo } from "react";
import type { LiveMarkerView, MetricView, MetricsHistoryView, RestartView } from "../api/types";
import { formatNumber } from "../format";
import { CHART_PAD, CHART_WIDTH, ValueGrid } from "./ChartFrame";
import { LIVE_MARKER_COLOURS } from "./LiveGroup";
import { Empty, Panel } from "./Panel";

const HEIGHT = 150;
const MAX_CHARTS = 6;
const MAX_RANK_LINES = 16;
const RANK_COLOURS = ["#38bdf8", "#fbbf24", "#a78bfa", "#22c55e", "#f472b6", "#fb923c"];
const JOB_COLOUR = "#f8fafc";

interface Line {
  readonly label: string;
  readonly colour: string;
  readonly width: number;
  readonly steps: readonly number[];
  readonly values: readonly number[];
}

/** Rates add up across ranks; anything else (a loss, an accuracy) is averaged. */
export function addsUp(name: string): boolean {
  return name.endsWith("_per_s") || name.includes("throughput");
}

function niceCeiling(value: number): number {
  if (value <= 0 || !Number.isFinite(value)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * power) return step * power;
  return 10 * power;
}

export function linesOf(name: string, history: MetricView): Line[] {
  const total = addsUp(name);
  const shown = history.workers.slice(0, MAX_RANK_LINES);
  // A restarted rank has a line per process: those are told apart by worker id.
  const perRank = new Map<number | null, number>();
  for (const worker of shown) perRank.set(worker.rank, (perRank.get(worker.rank) ?? 0) + 1);
  const ranks = shown.map((worker, index) => ({
    label:
      worker.rank === null
        ? worker.worker
        : (perRank.get(worker.rank) ?? 0) > 1
          ? `rank ${worker.rank} (${worker.worker})`
          : `rank ${worker.rank}`,
    colour: RANK_COLOURS[index % RANK_COLOURS.length] ?? "#94a3b8",
    width: 1.1,
    steps: worker.steps,
    values: worker.values,
  }));
  const job: Line = {
    label: total ? "job total" : "job mean",
    colour: JOB_COLOUR,
    width: 2.2,
    steps: history.job.steps,
    values: total ? history.job.total : history.job.mean,
  };
  // With one rank the job's line is that rank's: draw it once.
  return history.workers.length > 1 ? [...ranks, job] : [job];
}

/** A restart on a step axis: its marker and the steps trained again after it. */
export interface RestartSpan {
  readonly marker: number;
  /** The first and last step trained twice (none when they are not known yet). */
  readonly retrained: readonly [number, number] | null;
  readonly label: string;
}

export function restartSpans(restarts: readonly RestartView[]): RestartSpan[] {
  return restarts.map((restart) => {
    const resumed = restart.resumed_step;
    const ranks = `${restart.ranks.length === 1 ? "rank" : "ranks"} ${restart.ranks.join(", ")}`;
    if (resumed === null) {
      return {
        marker: restart.step_reached,
        retrained: null,
        label: `${ranks} restarted after step ${restart.step_reached}`,
      };
    }
    const retrained: readonly [number, number] | null =
      resumed <= restart.step_reached ? [resumed, restart.step_reached] : null;
    return {
      marker: resumed,
      retrained,
      label: retrained
        ? `${ranks} restarted: steps ${resumed}–${restart.step_reached} trained again`
        : `${ranks} restarted, resumed at step ${resumed}`,
    };
  });
}

/** The live group's changes a step chart marks: those placed at a step, discards left out (the
 * shrink that follows one marks the same place). */
export function stepMarkers(markers: readonly LiveMarkerView[]): LiveMarkerView[] {
  return markers.filter((marker) => marker.step !== null && marker.kind !== "discard");
}

const StepChart = memo(function StepChart(props: {
  name: string;
  history: MetricView;
  restarts: readonly RestartSpan[];
  live: readonly LiveMarkerView[];
}) {
  const { name, history, restarts, live } = props;
  const lines = useMemo(() => linesOf(name, history), [name, history]);
  let first = Infinity;
  let last = -Infinity;
  let low = 0;
  let high = 0;
  for (const line of lines) {
    line.steps.forEach((step, index) => {
      const value = line.values[index] ?? 0;
      first = Math.min(first, step);
      last = Math.max(last, step);
      low = Math.min(low, value);
      high = Math.max(high, value);
    });
  }
  if (!Number.isFinite(first)) first = last = 0;
  const span = Math.max(1, last - first);
  const top = niceCeiling(high * 1.05);
  const bottom = low < 0 ? -niceCeiling(-low * 1.05) : 0;
  const plotW = CHART_WIDTH - CHART_PAD.left - CHART_PAD.right;
  const plotH = HEIGHT - CHART_PAD.top - CHART_PAD.bottom;
  const x = (step: number): number => CHART_PAD.left + ((step - first) / span) * plotW;
  const y = (value: number): number => CHART_PAD.top + plotH - ((value - bottom) / (top - bottom)) * plotH;
  const jobLine = lines[lines.length - 1];
  const latest = jobLine ? jobLine.values[jobLine.values.length - 1] : undefined;
  return (
    <figure>
      <figcaption>
        {name} <strong>{formatNumber(latest ?? null)}</strong>
        <span className="muted"> · {jobLine?.label}</span>
      </figcaption>
      <svg
        className="chart"
        viewBox={`0 0 ${CHART_WIDTH} ${HEIGHT}`}
        role="img"
        aria-label={`${name} by step: ${lines.map((line) => line.label).join(", ")}`}
        data-testid={`training-chart-${name}`}
        data-points={history.job.steps.length}
        data-last-step={history.job.steps[history.job.steps.length - 1] ?? ""}
        data-ranks={history.workers.length}
      >
        <ValueGrid ticks={[bottom, (bottom + top) / 2, top]} y={y} />
        <text className="axis" x={CHART_PAD.left} y={HEIGHT - 5}>
          step {formatNumber(first)}
        </text>
        <text className="axis" x={CHART_WIDTH - CHART_PAD.right} y={HEIGHT - 5} textAnchor="end">
          {formatNumber(last)}
        </text>
        {history.stride > 1 && (
          <text className="axis unit" x={CHART_PAD.left + plotW / 2} y={HEIGHT - 5} textAnchor="middle">
            per {formatNumber(history.stride)} steps
          </text>
        )}
        {restarts.map((restart, index) => {
          const inside = (step: number): number => Math.min(last, Math.max(first, step));
          return (
            <g key={index} data-testid="restart-marker" data-step={restart.marker}>
              {restart.retrained && (
                <rect
                  className="retrained"
                  data-testid="retrained-steps"
                  data-from={restart.retrained[0]}
                  data-to={restart.retrained[1]}
                  x={x(inside(restart.retrained[0]))}
                  width={Math.max(1, x(inside(restart.retrained[1])) - x(inside(restart.retrained[0])))}
                  y={CHART_PAD.top}
                  height={plotH}
                />
              )}
              <line
                className="restart-marker"
                x1={x(inside(restart.marker))}
                x2={x(inside(restart.marker))}
                y1={CHART_PAD.top}
                y2={CHART_PAD.top + plotH}
              />
              <title>{restart.label}</title>
            </g>
          );
        })}
        {live.map((marker, index) => {
          const step = Math.min(last, Math.max(first, marker.step ?? first));
          return (
            <line
              key={`live-${index}`}
              className="live-marker"
              data-testid="live-marker"
              data-kind={marker.kind}
              data-step={marker.step ?? ""}
              stroke={LIVE_MARKER_COLOURS[marker.kind]}
              x1={x(step)}
              x2={x(step)}
              y1={CHART_PAD.top}
              y2={CHART_PAD.top + plotH}
            >
              <title>{marker.label}</title>
            </line>
          );
        })}
        {lines.map((line) => (
          <path
            key={line.label}
            d={line.steps
              .map((step, index) => {
                const point = `${x(step).toFixed(1)},${y(line.values[index] ?? 0).toFixed(1)}`;
                return `${index === 0 ? "M" : "L"}${point}`;
              })
              .join("")}
            fill="none"
            stroke={line.colour}
            strokeWidth={line.width}
          >
            <title>{line.label}</title>
          </path>
        ))}
      </svg>
      <ul className="chart-legend">
        {lines.map((line) => (
          <li key={line.label}>
            <span className="swatch line" style={{ backgroundColor: line.colour }} />
            {line.label} <strong>{formatNumber(line.values[line.values.length - 1] ?? null)}</strong>
          </li>
        ))}
        {restarts.some((restart) => restart.retrained) && (
          <li>
            <span className="swatch retrained" />
            trained again after a restart
          </li>
        )}
      </ul>
    </figure>
  );
});

/** Losses first (names containing "loss"), then the other metrics, each group by name. */
export function ordered(names: readonly string[]): string[] {
  const isLoss = (name: string): number => Number(name.includes("loss"));
  return [...names].sort((a, b) => isLoss(b) - isLoss(a) || (a < b ? -1 : a > b ? 1 : 0));
}

export function TrainingCharts(props: {
  metrics: MetricsHistoryView | null;
  restarts: readonly RestartView[];
  live: readonly LiveMarkerView[];
  replaying: boolean;
}) {
  const { metrics, replaying } = props;
  const spans = useMemo(() => restartSpans(props.restarts), [props.restarts]);
  const marked = useMemo(() => stepMarkers(props.live), [props.live]);
  const names = metrics ? ordered(Object.keys(metrics.metrics)) : [];
  const shown = names.slice(0, MAX_CHARTS);
  const subtitle = replaying
    ? "as logged up to the replayed point"
    : names.length > MAX_CHARTS
      ? `${MAX_CHARTS} of ${names.length} metrics`
      : "logged by the workers, by step";
  return (
    <Panel
      title="Training metrics"
      subtitle={subtitle}
      className="span-3 charts"
      testId="training-metrics"
    >
      {metrics === null ? (
        <Empty>Loading the training metrics…</Empty>
      ) : shown.length === 0 ? (
        <Empty>
          No training metrics {replaying ? "by then" : "yet"}: workers log them with{" "}
          <code>worker.log_metrics({"{"}"loss": 0.31{"}"}, step=step)</code>.
        </Empty>
      ) : (
        <div className="chart-row">
          {shown.map((name) => {
            const history = metrics.metrics[name];
            return history ? (
              <StepChart key={name} name={name} history={history} restarts={spans} live={marked} />
            ) : null;
          })}
        </div>
      )}
    </Panel>
  );
}
