// What the dashboard's line charts share: their width and padding, the value gridlines with their
// labels, and the labels under both ends of the x axis.

import { formatNumber } from "../format";

export const CHART_WIDTH = 360;
export const CHART_PAD = { left: 44, right: 8, top: 10, bottom: 20 };

/** A gridline and its label at each of `ticks`, placed by `y`. */
export function ValueGrid(props: { ticks: readonly number[]; y: (value: number) => number }) {
  const { ticks, y } = props;
  return (
    <>
      {ticks.map((tick) => (
        <g key={tick}>
          <line
            className="gridline"
            x1={CHART_PAD.left}
            x2={CHART_WIDTH - CHART_PAD.right}
            y1={y(tick)}
            y2={y(tick)}
          />
          <text className="axis" x={CHART_PAD.left - 4} y={y(tick) + 3} textAnchor="end">
            {formatNumber(tick)}
          </text>
        </g>
      ))}
    </>
  );
}
