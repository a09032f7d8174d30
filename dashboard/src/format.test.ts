import { describe, expect, it } from "vitest";
import { formatAge, formatBytes, formatDurationMs, formatNumber, nsToMs } from "./format";

describe("formatters", () => {
  it("writes sizes in powers of 1000", () => {
    expect(formatBytes(0)).toBe("0 B");
    expect(formatBytes(999)).toBe("999 B");
    expect(formatBytes(1_500_000)).toBe("1.5 MB");
    expect(formatBytes(250_000_000_000)).toBe("250 GB");
    expect(formatBytes(null)).toBe("—");
  });

  it("keeps about three significant digits", () => {
    expect(formatNumber(0)).toBe("0");
    expect(formatNumber(0.012345)).toBe("0.0123");
    expect(formatNumber(12.345)).toBe("12.3");
    expect(formatNumber(123456)).toBe("123,456");
    expect(formatNumber(Number.NaN)).toBe("—");
    expect(formatNumber(undefined)).toBe("—");
  });

  it("picks the unit of a duration", () => {
    expect(formatDurationMs(0.5)).toBe("0.5 ms");
    expect(formatDurationMs(250)).toBe("250 ms");
    expect(formatDurationMs(90_000)).toBe("90 s");
    expect(formatDurationMs(30 * 60_000)).toBe("30 min");
    expect(formatDurationMs(3 * 3_600_000)).toBe("3 h");
    expect(formatDurationMs(null)).toBe("—");
  });

  it("counts an age between two server times, never negative", () => {
    const now = 1_800_000_000_000_000_000;
    expect(formatAge(now - 12_000_000_000, now)).toBe("12 s ago");
    expect(formatAge(now + 5_000_000, now)).toBe("0 ms ago");
    expect(formatAge(null, now)).toBe("—");
    expect(nsToMs(2_000_000)).toBe(2);
  });
});
