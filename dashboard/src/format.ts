// Formatting of figures for people: sizes, rates, durations and nanosecond timestamps.

const EMPTY = "—";

export function nsToMs(ns: number): number {
  return ns / 1e6;
}

export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined) return EMPTY;
  const units = ["B", "KB", "MB", "GB", "TB", "PB"];
  let value = bytes;
  let unit = 0;
  while (Math.abs(value) >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 || value >= 100 ? 0 : 1)} ${units[unit]}`;
}

// Intl formatters are costly to build; a page redrawn four times a second keeps them.
const WHOLE = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const FRACTION = new Intl.NumberFormat("en-US", { maximumFractionDigits: 3 });

/** A number with about three significant digits, or a dash when there is none. */
export function formatNumber(value: number | null | undefined, digits = 3): string {
  if (value === null || value === undefined || !Number.isFinite(value)) return EMPTY;
  if (value === 0) return "0";
  const magnitude = Math.abs(value);
  if (magnitude >= 10 ** digits) return WHOLE.format(Math.round(value));
  if (magnitude < 1) return String(Number(value.toPrecision(digits)));
  return FRACTION.format(Number(value.toPrecision(digits)));
}

export function formatDurationMs(ms: number | null | undefined): string {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return EMPTY;
  if (ms < 1) return `${formatNumber(ms, 2)} ms`;
  if (ms < 1000) return `${formatNumber(ms)} ms`;
  const seconds = ms / 1000;
  if (seconds < 120) return `${formatNumber(seconds)} s`;
  const minutes = seconds / 60;
  if (minutes < 120) return `${formatNumber(minutes)} min`;
  return `${formatNumber(minutes / 60)} h`;
}

/** "12.3 s ago" from two nanosecond timestamps (both from the server's clock). */
export function formatAge(thenNs: number | null | undefined, nowNs: number): string {
  if (thenNs === null || thenNs === undefined) return EMPTY;
  const ms = Math.max(0, nsToMs(nowNs - thenNs));
  return `${formatDurationMs(ms)} ago`;
}

function pad(value: number, width = 2): string {
  return String(value).padStart(width, "0");
}

/** Local wall-clock time with milliseconds, e.g. 14:03:22.417. */
export function formatClock(ns: number | null | undefined): string {
  if (ns === null || ns === undefined) return EMPTY;
  const date = new Date(nsToMs(ns));
  return `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}.${pad(
    date.getMilliseconds(),
    3,
  )}`;
}

export function formatDateTime(ns: number | null | undefined): string {
  if (ns === null || ns === undefined) return EMPTY;
  const date = new Date(nsToMs(ns));
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ${formatClock(ns)}`;
}
