import { useMemo } from "react";
import type { BarrierView, CheckpointView } from "../api/types";
import { formatBytes, formatClock, formatDurationMs, formatNumber } from "../format";
import { BARRIER_COLOURS, CHECKPOINT_COLOURS } from "../status";
import { Empty, Panel } from "./Panel";

const ROWS = 100;

export function Checkpoints(props: { checkpoints: readonly CheckpointView[] }) {
  const rows = useMemo(
    () => [...props.checkpoints].sort((a, b) => b.step - a.step).slice(0, ROWS),
    [props.checkpoints],
  );
  const committed = props.checkpoints.filter(
    (checkpoint) => checkpoint.status === "committed",
  ).length;
  return (
    <Panel
      title="Checkpoints"
      subtitle={`${props.checkpoints.length} · ${committed} committed`}
      testId="checkpoints"
    >
      {rows.length === 0 ? (
        <Empty>No checkpoint started in this job.</Empty>
      ) : (
        <div className="table-wrap">
          <table>
            <thead>
              <tr>
                <th>step</th>
                <th>epoch</th>
                <th>status</th>
                <th className="num">size</th>
                <th className="num">commit</th>
                <th className="num">MB/s</th>
                <th>committed</th>
                <th>reason</th>
              </tr>
            </thead>
            <tbody>
              {rows.map((checkpoint, row) => (
                <tr key={`${checkpoint.step}-${row}`} data-testid={`checkpoint-${checkpoint.step}`}>
                  <td>{checkpoint.step}</td>
                  <td>{checkpoint.epoch}</td>
                  <td>
                    <span
                      className="pill"
                      style={{ backgroundColor: CHECKPOINT_COLOURS[checkpoint.status] }}
                    >
                      {checkpoint.status}
                    </span>
                  </td>
                  <td className="num">{formatBytes(checkpoint.bytes)}</td>
                  <td className="num">{formatDurationMs(checkpoint.duration_ms)}</td>
                  <td className="num">
                    {checkpoint.duration_ms
                      ? formatNumber(checkpoint.bytes / 1e6 / (checkpoint.duration_ms / 1000))
                      : "—"}
                  </td>
                  <td>{formatClock(checkpoint.committed_at)}</td>
                  <td className="reason" title={checkpoint.reason}>
                    {checkpoint.reason}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
    </Panel>
  );
}

export function Barriers(props: { barriers: readonly BarrierView[] }) {
  const rows = useMemo(
    () =>
      [...props.barriers]
        .sort((a, b) => a.name.localeCompare(b.name) || b.generation - a.generation)
        .slice(0, ROWS),
    [props.barriers],
  );
  return (
    <Panel title="Barriers" subtitle={`${props.barriers.length}`} testId="barriers">
      {rows.length === 0 ? (
        <Empty>No barrier opened in this job.</Empty>
      ) : (
        <div className="table-wrap">
          <table>
            <thead>
              <tr>
                <th>name</th>
                <th className="num">gen</th>
                <th className="num">arrived</th>
                <th>status</th>
                <th className="num">latency</th>
              </tr>
            </thead>
            <tbody>
              {rows.map((barrier) => (
                <tr key={`${barrier.name}#${barrier.generation}`}>
                  <td>{barrier.name}</td>
                  <td className="num">{barrier.generation}</td>
                  <td className="num">
                    {barrier.arrived} / {barrier.expected}
                  </td>
                  <td>
                    <span
                      className="pill"
                      style={{ backgroundColor: BARRIER_COLOURS[barrier.status] }}
                    >
                      {barrier.status.replace("_", " ")}
                    </span>
                  </td>
                  <td className="num">{formatDurationMs(barrier.latency_ms)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
    </Panel>
  );
}
