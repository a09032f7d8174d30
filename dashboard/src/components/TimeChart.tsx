// A small SVG time-series chart: lines (gaps where a value is null), optional dots, a y axis
// from zero to a rounded maximum, and a time axis ending at the newest sample.

import { memo } from "react";
import { formatNumber } from "../format";
import { CHART_PAD, CHART_WIDTH, ValueGrid } from "./ChartFrame";

export interface Series {
  readonly label: string;
  readonly colour: string;
  /** [time ms, value] in time order; null leaves a gap. */
  readonly points: ReadonlyArray<readonly [number, number | null]>;
}

export interface Dot {
  readonly t: number;
  readonly value: number;
  readonly label: string;
}

const HEIGHT = 140;

function niceCeiling(value: number): number {
  if (value <= 0 || !Number.isFinite(value)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (value <= step * power) return step * power;
  }
  return 10 * power;
}

function path(points: ReadonlyArray<readonly [number, number]>): string {
  return points
    .map(([x, y], index) => `${index === 0 ? "M" : "L"}${x.toFixed(1)},${y.toFixed(1)}`)
    .join("");
}

export const TimeChart = memo(function TimeChart(props: {
  series: readonly Series[];
  dots?: readonly Dot[];
  dotColour?: string;
  windowMs: number;
  /** The right edge of the time axis (ms). */
  endMs: number;
  unit: string;
  /** A vertical marker, e.g. the time a replay shows. */
  markerMs?: number | null;
  testId?: string;
}) {
  const { series, dots = [], windowMs, endMs, unit } = props;
  const startMs = endMs - windowMs;
  let maxValue = 0;
  for (const line of series) {
    for (const [t, value] of line.points) {
      if (value !== null && t >= startMs && value > maxValue) maxValue = value;
    }
  }
  for (const dot of dots) if (dot.t >= startMs && dot.value > maxValue) maxValue = dot.value;
  const top = niceCeiling(maxValue * 1.05);
  const plotW = CHART_WIDTH - CHART_PAD.left - CHART_PAD.right;
  const plotH = HEIGHT - CHART_PAD.top - CHART_PAD.bottom;
  const x = (t: number): number => CHART_PAD.left + ((t - startMs) / windowMs) * plotW;
  const y = (value: number): number => CHART_PAD.top + plotH - (value / top) * plotH;

  const segmentsOf = (line: Series): string[] => {
    const segments: string[] = [];
    let current: [number, number][] = [];
    for (const [t, value] of line.points) {
      if (t < startMs) continue;
      if (value === null) {
        if (current.length) segments.push(path(current));
        current = [];
      } else {
        current.push([x(t), y(value)]);
      }
    }
    if (current.length) segments.push(path(current));
    return segments;
  };

  const ticks = [0, top / 2, top];
  const minutes = windowMs / 60000;
  return (
    <svg
      className="chart"
      viewBox={`0 0 ${CHART_WIDTH} ${HEIGHT}`}
      role="img"
      aria-label={series.map((line) => line.label).join(", ")}
      data-testid={props.testId}
    >
      <ValueGrid ticks={ticks} y={y} />
      <text className="axis" x={CHART_PAD.left} y={HEIGHT - 5}>
        −{formatNumber(minutes)} min
      </text>
      <text className="axis" x={CHART_WIDTH - CHART_PAD.right} y={HEIGHT - 5} textAnchor="end">
        now
      </text>
      <text className="axis unit" x={CHART_PAD.left + plotW / 2} y={HEIGHT - 5} textAnchor="middle">
        {unit}
      </text>
      {props.markerMs !== undefined && props.markerMs !== null && props.markerMs >= startMs && (
        <line
          className="marker"
          x1={x(props.markerMs)}
          x2={x(props.markerMs)}
          y1={CHART_PAD.top}
          y2={CHART_PAD.top + plotH}
        />
      )}
      {series.map((line) =>
        segmentsOf(line).map((d, index) => (
          <path
            key={`${line.label}-${index}`}
            d={d}
            fill="none"
            stroke={line.colour}
            strokeWidth={1.6}
          />
        )),
      )}
      {dots
        .filter((dot) => dot.t >= startMs && dot.t <= endMs)
        .map((dot) => (
          <circle
            key={`${dot.t}-${dot.label}`}
            cx={x(dot.t)}
            cy={y(dot.value)}
            r={3.2}
            fill={props.dotColour ?? "#fff"}
          >
            <title>{dot.label}</title>
          </circle>
        ))}
    </svg>
  );
});
