// Live recovery (`strata.torch.live.LiveGroup`): the group's world size over time as a step line,
// a dot for each change (shrink, growth, heal, discarded step), and the changes listed with what
// the read model says happened. Every figure and line comes from the document (`live`).

import { memo } from "react";
import type { LiveMarkerView, LiveView } from "../api/types";
import { formatNumber, nsToMs } from "../format";
import { CHART_PAD, CHART_WIDTH, ValueGrid } from "./ChartFrame";
import { Panel } from "./Panel";

const HEIGHT = 140;
const LISTED = 12;

export const LIVE_MARKER_COLOURS: Readonly<Record<LiveMarkerView["kind"], string>> = {
  shrink: "#f87171",
  grow: "#22c55e",
  heal: "#38bdf8",
  discard: "#fbbf24",
};

const WorldChart = memo(function WorldChart(props: { live: LiveView; endNs: number }) {
  const { world, markers } = props.live;
  const startMs = nsToMs(world[0]?.at ?? props.endNs);
  const endMs = Math.max(startMs + 1, nsToMs(props.endNs));
  const top = Math.max(1, ...world.map((point) => point.world_size));
  const plotW = CHART_WIDTH - CHART_PAD.left - CHART_PAD.right;
  const plotH = HEIGHT - CHART_PAD.top - CHART_PAD.bottom;
  const x = (ms: number): number => CHART_PAD.left + ((ms - startMs) / (endMs - startMs)) * plotW;
  const y = (size: number): number => CHART_PAD.top + plotH - (size / top) * plotH;
  // A step line: each group's size holds until the next forms.
  const parts: string[] = [];
  let previous: number | null = null;
  for (const point of world) {
    const at = x(nsToMs(point.at)).toFixed(1);
    if (previous !== null) parts.push(`L${at},${y(previous).toFixed(1)}`);
    parts.push(`${previous === null ? "M" : "L"}${at},${y(point.world_size).toFixed(1)}`);
    previous = point.world_size;
  }
  const path = parts.join("");
  const last = world[world.length - 1];
  const end = last ? `L${x(endMs).toFixed(1)},${y(last.world_size).toFixed(1)}` : "";
  return (
    <svg
      className="chart"
      viewBox={`0 0 ${CHART_WIDTH} ${HEIGHT}`}
      role="img"
      aria-label="world size of the live group over time"
      data-testid="live-world-chart"
      data-points={world.length}
      data-world-sizes={world.map((point) => point.world_size).join(",")}
    >
      <ValueGrid ticks={[0, top]} y={y} />
      <text className="axis" x={CHART_PAD.left} y={HEIGHT - 5}>
        first group
      </text>
      <text className="axis" x={CHART_WIDTH - CHART_PAD.right} y={HEIGHT - 5} textAnchor="end">
        now
      </text>
      <text className="axis unit" x={CHART_PAD.left + plotW / 2} y={HEIGHT - 5} textAnchor="middle">
        world size
      </text>
      <path d={path + end} fill="none" stroke="#f8fafc" strokeWidth={1.8} />
      {markers.map((marker, index) => (
        <circle
          key={index}
          className={`live-dot live-${marker.kind}`}
          data-testid="live-dot"
          data-kind={marker.kind}
          cx={x(Math.min(endMs, Math.max(startMs, nsToMs(marker.at))))}
          cy={CHART_PAD.top + plotH - 3}
          r={3.2}
          fill={LIVE_MARKER_COLOURS[marker.kind]}
        >
          <title>{marker.label}</title>
        </circle>
      ))}
    </svg>
  );
});

function counted(count: number, noun: string): string {
  return `${count} ${noun}${count === 1 ? "" : "s"}`;
}

export function LiveGroup(props: { live: LiveView; endNs: number }) {
  const { live } = props;
  if (live.quorums === 0) return null;
  const listed = live.markers.slice(-LISTED).reverse();
  const subtitle =
    `world ${formatNumber(live.world_size)} · ${counted(live.quorums, "group")} formed · ` +
    `${counted(live.heals, "heal")} · ${counted(live.discarded_steps, "step")} discarded`;
  return (
    <Panel title="Live group" subtitle={subtitle} className="span-3 charts" testId="live-group">
      <div className="chart-row">
        <figure>
          <figcaption>World size</figcaption>
          <WorldChart live={live} endNs={props.endNs} />
          <ul className="chart-legend">
            {(Object.keys(LIVE_MARKER_COLOURS) as LiveMarkerView["kind"][]).map((kind) => (
              <li key={kind}>
                <span className="swatch" style={{ backgroundColor: LIVE_MARKER_COLOURS[kind] }} />
                {kind}
              </li>
            ))}
          </ul>
        </figure>
        <ol className="live-changes" data-testid="live-changes">
          {listed.map((marker, index) => (
            <li key={index} data-kind={marker.kind} data-step={marker.step ?? ""}>
              <span className="swatch" style={{ backgroundColor: LIVE_MARKER_COLOURS[marker.kind] }} />
              {marker.label}
            </li>
          ))}
        </ol>
      </div>
    </Panel>
  );
}
