// The worker health grid: one cell per worker, coloured by state. Cells are memoized on
// (id, rank, status, size) and the details of the hovered worker are looked up on demand, so a
// heartbeat only re-renders the one status line and a 1,000-worker grid stays cheap.

import { memo, useCallback, useMemo, useState } from "react";
import type { MouseEvent } from "react";
import { WORKER_VIEW_STATUS } from "../api/types";
import type { WorkerView, WorkerViewStatus } from "../api/types";
import { formatAge } from "../format";
import { WORKER_COLOURS, WORKER_MEANING } from "../status";
import { Empty, Panel } from "./Panel";

type CellSize = "large" | "medium" | "small";

function cellSize(count: number): CellSize {
  if (count <= 64) return "large";
  if (count <= 400) return "medium";
  return "small";
}

const WorkerCell = memo(function WorkerCell(props: {
  id: string;
  rank: number;
  status: WorkerViewStatus;
  size: CellSize;
  selected: boolean;
}) {
  return (
    <div
      className={`cell cell-${props.size} status-${props.status}${props.selected ? " selected" : ""}`}
      data-testid={`worker-${props.id}`}
      data-status={props.status}
      data-id={props.id}
      role="gridcell"
      aria-label={`rank ${props.rank} ${props.id}: ${props.status}`}
    >
      {props.size === "large" ? props.rank : null}
    </div>
  );
});

function WorkerDetails(props: { worker: WorkerView | undefined; nowNs: number }) {
  const { worker } = props;
  if (!worker) {
    return <p className="grid-details muted">Point at a worker for its details.</p>;
  }
  return (
    <p className="grid-details" data-testid="worker-details">
      <strong>rank {worker.rank}</strong> <code>{worker.id}</code>{" "}
      <span className="pill" style={{ backgroundColor: WORKER_COLOURS[worker.status] }}>
        {worker.status}
      </span>{" "}
      step {worker.step} · epoch {worker.epoch} · {worker.shards} shards ·{" "}
      {worker.hostname || "no hostname"} · last heartbeat{" "}
      {formatAge(worker.last_heartbeat, props.nowNs)}
    </p>
  );
}

/** Every worker as a row, for jobs small enough that the grid leaves room. */
function WorkerTable(props: { workers: readonly WorkerView[]; nowNs: number }) {
  return (
    <div className="table-wrap worker-table">
      <table>
        <thead>
          <tr>
            <th className="num">rank</th>
            <th>worker</th>
            <th>host</th>
            <th>status</th>
            <th className="num">step</th>
            <th className="num">epoch</th>
            <th className="num">shards</th>
            <th className="num">last heartbeat</th>
          </tr>
        </thead>
        <tbody>
          {props.workers.map((worker) => (
            <tr key={worker.id}>
              <td className="num">{worker.rank}</td>
              <td>
                <code>{worker.id}</code>
              </td>
              <td>{worker.hostname || "—"}</td>
              <td>
                <span className="pill" style={{ backgroundColor: WORKER_COLOURS[worker.status] }}>
                  {worker.status}
                </span>
              </td>
              <td className="num">{worker.step}</td>
              <td className="num">{worker.epoch}</td>
              <td className="num">{worker.shards}</td>
              <td className="num">{formatAge(worker.last_heartbeat, props.nowNs)}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

export function WorkerGrid(props: { workers: readonly WorkerView[]; nowNs: number }) {
  const { workers, nowNs } = props;
  const [pointed, setPointed] = useState<string | null>(null);
  const [pinned, setPinned] = useState<string | null>(null);

  const sorted = useMemo(
    () => [...workers].sort((a, b) => a.rank - b.rank || a.id.localeCompare(b.id)),
    [workers],
  );
  const byId = useMemo(() => new Map(workers.map((worker) => [worker.id, worker])), [workers]);
  const counts = useMemo(() => {
    const result = Object.fromEntries(WORKER_VIEW_STATUS.map((status) => [status, 0])) as Record<
      WorkerViewStatus,
      number
    >;
    for (const worker of workers) result[worker.status] += 1;
    return result;
  }, [workers]);

  const idAt = (event: MouseEvent<HTMLDivElement>): string | null =>
    (event.target as HTMLElement).closest<HTMLElement>("[data-id]")?.dataset["id"] ?? null;
  const onMove = useCallback((event: MouseEvent<HTMLDivElement>) => setPointed(idAt(event)), []);
  const onClick = useCallback((event: MouseEvent<HTMLDivElement>) => {
    const id = idAt(event);
    setPinned((current) => (current === id ? null : id));
  }, []);

  const size = cellSize(workers.length);
  const shown = pointed ?? pinned;
  return (
    <Panel
      title="Workers"
      subtitle={`${workers.length} by rank`}
      className="span-2"
      testId="worker-grid"
    >
      <ul className="legend" aria-label="worker states">
        {WORKER_VIEW_STATUS.map((status) => (
          <li key={status} title={WORKER_MEANING[status]} data-testid={`legend-${status}`}>
            <span className="swatch" style={{ backgroundColor: WORKER_COLOURS[status] }} />
            {status} <span className="count">{counts[status]}</span>
          </li>
        ))}
      </ul>
      {sorted.length === 0 ? (
        <Empty>No worker has registered in this job.</Empty>
      ) : (
        <div
          className={`grid grid-${size}`}
          role="grid"
          aria-label="worker health"
          onMouseMove={onMove}
          onMouseLeave={() => setPointed(null)}
          onClick={onClick}
        >
          {sorted.map((worker) => (
            <WorkerCell
              key={worker.id}
              id={worker.id}
              rank={worker.rank}
              status={worker.status}
              size={size}
              selected={worker.id === pinned}
            />
          ))}
        </div>
      )}
      {size === "large" ? (
        <WorkerTable workers={sorted} nowNs={nowNs} />
      ) : (
        <WorkerDetails worker={shown ? byId.get(shown) : undefined} nowNs={nowNs} />
      )}
    </Panel>
  );
}
