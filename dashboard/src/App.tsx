import { useCallback, useEffect, useMemo, useState } from "react";
import { ApiError, AuthRequired, storeToken, storedToken } from "./api/client";
import type { JobSummary } from "./api/types";
import { Charts } from "./components/Charts";
import { Barriers, Checkpoints } from "./components/Checkpoints";
import { EventLog } from "./components/EventLog";
import { LiveGroup } from "./components/LiveGroup";
import { ModeBanner } from "./components/ModeBanner";
import { Overview } from "./components/Overview";
import { ShardDistribution } from "./components/ShardDistribution";
import { TimeTravel } from "./components/TimeTravel";
import { TokenDialog } from "./components/TokenDialog";
import { TrainingCharts } from "./components/TrainingCharts";
import { WorkerGrid } from "./components/WorkerGrid";
import { nsToMs } from "./format";
import { useEventIndex } from "./hooks/useEventIndex";
import { useJobs } from "./hooks/useJobs";
import { useLiveDashboard } from "./hooks/useLiveDashboard";
import { useReplay } from "./hooks/useReplay";
import { useTrainingMetrics } from "./hooks/useTrainingMetrics";
import { landingJob } from "./landing";

type ErrorSource = "live" | "other";
const CLOCK_MS = 1000;
const OTHER_ERROR_MS = 10_000;

interface Location {
  job: string | null;
  seq: number | null;
}

function readLocation(): Location {
  const params = new URLSearchParams(window.location.search);
  const seq = Number(params.get("seq"));
  return {
    job: params.get("job") || null,
    seq: params.has("seq") && Number.isInteger(seq) && seq > 0 ? seq : null,
  };
}

/** Keep ?job= and ?seq= in the address bar, so a replay can be shared as a link. */
function writeLocation(location: Location): void {
  const params = new URLSearchParams(window.location.search);
  if (location.job) params.set("job", location.job);
  else params.delete("job");
  if (location.seq !== null) params.set("seq", String(location.seq));
  else params.delete("seq");
  const search = params.toString();
  const url = `${window.location.pathname}${search ? `?${search}` : ""}${window.location.hash}`;
  if (url !== `${window.location.pathname}${window.location.search}${window.location.hash}`) {
    window.history.replaceState(null, "", url);
  }
}

/** The time (ms), read again every `everyMs` (null: not at all): renders read the clock here. */
function useClock(everyMs: number | null): number {
  const [now, setNow] = useState(() => Date.now());
  useEffect(() => {
    if (everyMs === null) return;
    const timer = window.setInterval(() => setNow(Date.now()), everyMs);
    return () => window.clearInterval(timer);
  }, [everyMs]);
  return now;
}

function JobPicker(props: {
  jobs: readonly JobSummary[] | null;
  job: string | null;
  /** The open job's live figures, fresher than the job list's. */
  current: { workers: number; live: number; events?: number } | null;
  onPick: (job: string) => void;
}) {
  const known = (props.jobs ?? []).map((entry) =>
    entry.job === props.job && props.current ? { ...entry, ...props.current } : entry,
  );
  const listed = props.job === null || known.some((entry) => entry.job === props.job);
  return (
    <select
      className="job-picker"
      aria-label="job"
      data-testid="job-picker"
      value={props.job ?? ""}
      onChange={(event) => props.onPick(event.target.value)}
    >
      {props.job === null && (
        <option value="">{props.jobs === null ? "loading jobs…" : "no jobs"}</option>
      )}
      {!listed && props.job !== null && <option value={props.job}>{props.job}</option>}
      {known.map((entry) => (
        <option key={entry.job} value={entry.job}>
          {entry.job} · {entry.live}/{entry.workers} live
          {entry.restarts > 0 ? ` · ${entry.restarts} restart${entry.restarts > 1 ? "s" : ""}` : ""} ·{" "}
          {entry.events} events
        </option>
      ))}
    </select>
  );
}

export function App() {
  const [initial] = useState(readLocation);
  const [job, setJob] = useState<string | null>(initial.job);
  const [replaySeq, setReplaySeq] = useState<number | null>(initial.seq);
  const [authVersion, setAuthVersion] = useState(0);
  const [tokenNeeded, setTokenNeeded] = useState<{ rejected: boolean } | null>(null);
  const [error, setError] = useState<{ message: string; source: ErrorSource } | null>(null);

  // Errors of the live connection clear when it recovers; others (a replay, the event index,
  // the job list) stay a few seconds or until dismissed.
  const report = useCallback((reason: unknown, source: ErrorSource) => {
    if (reason instanceof AuthRequired) {
      setTokenNeeded({ rejected: storedToken() !== null });
      return;
    }
    const message =
      reason instanceof ApiError || reason instanceof Error ? reason.message : String(reason);
    setError({ message, source });
  }, []);
  const onLiveError = useCallback((reason: unknown) => report(reason, "live"), [report]);
  const onOtherError = useCallback((reason: unknown) => report(reason, "other"), [report]);

  // With no job in the address, the landing job opens once the job list first has one.
  const land = useCallback((listed: readonly JobSummary[]) => {
    if (listed.length > 0) setJob((open) => open ?? landingJob(listed));
  }, []);
  const jobs = useJobs(authVersion, onOtherError, land);
  const live = useLiveDashboard(job, authVersion, onLiveError);
  const index = useEventIndex(job, live.state, authVersion, onOtherError);
  const replay = useReplay(job, replaySeq, authVersion, onOtherError);

  useEffect(() => writeLocation({ job, seq: replaySeq }), [job, replaySeq]);
  // An error of the live connection clears when a state arrives: adjusted while rendering.
  const [liveState, setLiveState] = useState(live.state);
  if (live.state !== liveState) {
    setLiveState(live.state);
    if (live.state) setError((shown) => (shown?.source === "live" ? null : shown));
  }
  useEffect(() => {
    if (error?.source !== "other") return;
    const timer = window.setTimeout(() => setError(null), OTHER_ERROR_MS);
    return () => window.clearTimeout(timer);
  }, [error]);

  const pickJob = useCallback((next: string) => {
    setJob(next || null);
    setReplaySeq(null);
  }, []);
  const seek = useCallback((seq: number | null) => setReplaySeq(seq), []);
  const goLive = useCallback(() => setReplaySeq(null), []);
  const submitToken = useCallback((token: string) => {
    storeToken(token);
    setTokenNeeded(null);
    setError(null);
    setAuthVersion((value) => value + 1);
  }, []);

  const current = useMemo(() => {
    const figures = live.state?.figures;
    if (!figures) return null;
    const counts = { workers: figures.workers, live: figures.live };
    return index.complete ? { ...counts, events: index.entries.length } : counts;
  }, [live.state, index.entries, index.complete]);

  const replaying = replaySeq !== null;
  const shown = replaying ? replay.state : live.state;
  // Ages ("3 s ago") count from now when live (the clock, or the last state's arrival if
  // later), from the replayed event's time in a replay.
  const clock = useClock(replaying ? null : CLOCK_MS);
  const nowNs = replaying ? (shown?.ts ?? 0) : Math.max(clock, live.receivedAt ?? 0) * 1e6;
  // Time travel: the training metrics stored by the replayed event's time.
  const training = useTrainingMetrics(
    job,
    replaying ? (replay.state?.ts ?? null) : null,
    authVersion,
    onOtherError,
  );

  return (
    <div className={`app ${replaying ? "is-replay" : "is-live"}`}>
      <header className="top">
        <h1>
          <span className="logo" aria-hidden="true" />
          Strata
        </h1>
        <JobPicker jobs={jobs} job={job} current={current} onPick={pickJob} />
        <ModeBanner
          replaySeq={replaySeq}
          replayTs={replay.state?.ts ?? null}
          loading={replay.loading}
          connection={live.connection}
          receivedAt={live.receivedAt}
          onLive={goLive}
        />
        <span className="seq-now muted" data-testid="state-seq">
          {shown ? `state at seq ${shown.seq}` : ""}
        </span>
      </header>
      {job !== null && (
        <TimeTravel
          entries={index.entries}
          complete={index.complete}
          replaySeq={replaySeq}
          onSeek={seek}
        />
      )}
      {error && (
        <div className="error" role="alert">
          {error.message}
          <button type="button" onClick={() => setError(null)} aria-label="dismiss">
            ×
          </button>
        </div>
      )}
      {job === null ? (
        <p className="placeholder">
          {jobs === null
            ? "Loading jobs…"
            : "No job has recorded events yet. Start workers with strata.Worker(job=...) and they appear here."}
        </p>
      ) : shown === null ? (
        <p className="placeholder">
          {replaying ? `Replaying the job up to seq ${replaySeq}…` : "Loading the job…"}
        </p>
      ) : (
        <main className="layout">
          <Overview state={shown} replay={replaying} nowNs={nowNs} />
          <Charts
            history={live.history}
            checkpoints={shown.checkpoints}
            replayMs={replaying ? nsToMs(shown.ts) : null}
          />
          <LiveGroup live={shown.live} endNs={shown.ts} />
          <TrainingCharts
            metrics={training}
            restarts={shown.restarts}
            live={shown.live.markers}
            replaying={replaying}
          />
          <WorkerGrid workers={shown.workers} nowNs={nowNs} />
          <ShardDistribution
            datasets={shown.datasets}
            workers={shown.workers}
            metrics={shown.metrics}
          />
          <Checkpoints checkpoints={shown.checkpoints} />
          <Barriers barriers={shown.barriers} />
          <EventLog
            entries={index.entries.length > 0 ? index.entries : shown.recent_events}
            replaySeq={replaySeq}
            onPick={seek}
          />
        </main>
      )}
      {tokenNeeded && <TokenDialog rejected={tokenNeeded.rejected} onSubmit={submitToken} />}
    </div>
  );
}
