// The live event log: the job's events, newest first, filtered by type (or area) and by text.
// In replay it shows the events up to the replayed sequence. Clicking a row replays that event.
// The list is windowed (fixed row height), so the whole history scrolls at the cost of a screenful.

import { memo, useDeferredValue, useEffect, useMemo, useRef, useState } from "react";
import type { CSSProperties } from "react";
import type { RecentEvent } from "../api/types";
import { formatClock } from "../format";
import { EVENT_AREAS, EVENT_DESCRIPTIONS, EVENT_TYPES } from "../generated/events";
import { areaColour } from "../status";
import { Panel } from "./Panel";

const ROW_PX = 21;
const VIEW_PX = 360;
const OVERSCAN = 8;

function matcher(type: string, text: string): (event: RecentEvent) => boolean {
  const needle = text.trim().toLowerCase();
  const byType =
    type === ""
      ? () => true
      : type.endsWith(".")
        ? (event: RecentEvent) => event.type.startsWith(type)
        : (event: RecentEvent) => event.type === type;
  if (!needle) return byType;
  return (event) =>
    byType(event) &&
    (event.type.includes(needle) ||
      event.summary.toLowerCase().includes(needle) ||
      String(event.seq) === needle);
}

const Row = memo(function Row(props: {
  event: RecentEvent;
  top: number;
  current: boolean;
  onPick: (seq: number) => void;
}) {
  const { event } = props;
  const style: CSSProperties = { top: props.top };
  return (
    <li
      style={style}
      className={props.current ? "current" : undefined}
      data-seq={event.seq}
      data-type={event.type}
      onClick={() => props.onPick(event.seq)}
      title="Show the job as it was after this event"
    >
      <span className="seq">{event.seq}</span>
      <span className="time">{formatClock(event.ts)}</span>
      <span className="type" style={{ color: areaColour(event.type) }}>
        {event.type}
      </span>
      <span className="summary">{event.summary}</span>
    </li>
  );
});

export function EventLog(props: {
  entries: readonly RecentEvent[];
  replaySeq: number | null;
  onPick: (seq: number) => void;
}) {
  const { entries, replaySeq, onPick } = props;
  const [type, setType] = useState("");
  const [text, setText] = useState("");
  const deferredText = useDeferredValue(text);

  const rows = useMemo(() => {
    const accept = matcher(type, deferredText);
    const found: RecentEvent[] = [];
    for (let index = entries.length - 1; index >= 0; index -= 1) {
      const event = entries[index];
      if (!event || (replaySeq !== null && event.seq > replaySeq)) continue;
      if (accept(event)) found.push(event);
    }
    return found;
  }, [entries, type, deferredText, replaySeq]);

  const scroller = useRef<HTMLDivElement>(null);
  const [scrollTop, setScrollTop] = useState(0);
  const first = Math.max(0, Math.floor(scrollTop / ROW_PX) - OVERSCAN);
  const last = Math.min(rows.length, Math.ceil((scrollTop + VIEW_PX) / ROW_PX) + OVERSCAN);

  // In a replay, bring the replayed event into view.
  useEffect(() => {
    const box = scroller.current;
    if (!box || replaySeq === null) return;
    const index = rows.findIndex((event) => event.seq === replaySeq);
    if (index < 0) return;
    const top = index * ROW_PX;
    if (top < box.scrollTop || top + ROW_PX > box.scrollTop + VIEW_PX) {
      box.scrollTop = Math.max(0, top - VIEW_PX / 2);
    }
  }, [replaySeq, rows]);

  return (
    <Panel
      title="Event log"
      subtitle={`${rows.length} of ${entries.length} events`}
      className="span-3"
      testId="event-log"
      actions={
        <>
          <select
            aria-label="event type"
            data-testid="event-type-filter"
            value={type}
            onChange={(event) => setType(event.target.value)}
          >
            <option value="">all types</option>
            <optgroup label="areas">
              {EVENT_AREAS.map((area) => (
                <option key={area} value={`${area}.`}>
                  {area}.*
                </option>
              ))}
            </optgroup>
            <optgroup label="types">
              {EVENT_TYPES.map((name) => (
                <option key={name} value={name} title={EVENT_DESCRIPTIONS[name]}>
                  {name}
                </option>
              ))}
            </optgroup>
          </select>
          <input
            type="search"
            aria-label="filter text"
            data-testid="event-text-filter"
            placeholder="filter: worker id, step, seq…"
            value={text}
            onChange={(event) => setText(event.target.value)}
          />
        </>
      }
    >
      {rows.length === 0 ? (
        <p className="empty">
          {entries.length === 0 ? "No events yet." : "No event matches the filters."}
        </p>
      ) : (
        <div
          className="events"
          ref={scroller}
          style={{ height: Math.min(VIEW_PX, rows.length * ROW_PX) }}
          onScroll={(event) => setScrollTop(event.currentTarget.scrollTop)}
        >
          <ol style={{ height: rows.length * ROW_PX }} aria-rowcount={rows.length}>
            {rows.slice(first, last).map((event, offset) => (
              <Row
                key={event.seq}
                event={event}
                top={(first + offset) * ROW_PX}
                current={event.seq === replaySeq}
                onPick={onPick}
              />
            ))}
          </ol>
        </div>
      )}
    </Panel>
  );
}
