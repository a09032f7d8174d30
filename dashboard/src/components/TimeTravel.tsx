// The time-travel slider: one position per event of the job, the last one being "live". Moving
// it back shows the job as it was right after that event (GET /api/replay?seq=).

import type { RecentEvent } from "../api/types";
import { formatDateTime } from "../format";
import { areaColour } from "../status";

/** The index of the last entry with seq <= `seq` (entries are in seq order), or -1. */
export function indexAtOrBefore(entries: readonly RecentEvent[], seq: number): number {
  let low = 0;
  let high = entries.length - 1;
  let found = -1;
  while (low <= high) {
    const middle = (low + high) >> 1;
    const entry = entries[middle];
    if (entry && entry.seq <= seq) {
      found = middle;
      low = middle + 1;
    } else {
      high = middle - 1;
    }
  }
  return found;
}

export function TimeTravel(props: {
  entries: readonly RecentEvent[];
  complete: boolean;
  replaySeq: number | null;
  onSeek: (seq: number | null) => void;
}) {
  const { entries, replaySeq, onSeek } = props;
  const last = entries.length - 1;
  const position = replaySeq === null ? last : Math.max(0, indexAtOrBefore(entries, replaySeq));
  const at = entries[position];
  const seekIndex = (index: number): void => {
    const clamped = Math.min(Math.max(index, 0), last);
    const entry = entries[clamped];
    if (!entry) return;
    onSeek(clamped >= last ? null : entry.seq);
  };
  const disabled = entries.length < 2;
  return (
    <div className={`time-travel ${replaySeq === null ? "" : "replaying"}`}>
      <label htmlFor="time-travel-slider">Time travel</label>
      <button
        type="button"
        onClick={() => seekIndex(0)}
        disabled={disabled || position === 0}
        title="First event"
        aria-label="first event"
      >
        |◀
      </button>
      <button
        type="button"
        onClick={() => seekIndex(position - 1)}
        disabled={disabled || position === 0}
        title="Previous event"
        aria-label="previous event"
      >
        ◀
      </button>
      <input
        id="time-travel-slider"
        type="range"
        min={0}
        max={Math.max(0, last)}
        step={1}
        value={Math.max(0, position)}
        disabled={disabled}
        data-testid="time-travel"
        data-seq={at?.seq ?? ""}
        aria-valuetext={
          at ? `event ${position + 1} of ${entries.length}, seq ${at.seq}` : "no events"
        }
        onChange={(event) => seekIndex(Number(event.target.value))}
      />
      <button
        type="button"
        onClick={() => seekIndex(position + 1)}
        disabled={disabled || replaySeq === null}
        title="Next event"
        aria-label="next event"
      >
        ▶
      </button>
      <span className="time-travel-at" data-testid="time-travel-at">
        {at ? (
          <>
            <span className="muted">
              {position + 1}/{entries.length}
              {props.complete ? "" : "…"} · seq {at.seq} · {formatDateTime(at.ts)}
            </span>{" "}
            <span style={{ color: areaColour(at.type) }}>{at.type}</span>{" "}
            <span className="summary">{at.summary}</span>
          </>
        ) : (
          <span className="muted">loading the job's events…</span>
        )}
      </span>
    </div>
  );
}
