import { useEffect, useState } from "react";
import { formatDateTime } from "../format";
import type { Connection } from "../hooks/useLiveDashboard";

const CONNECTION_TEXT: Readonly<Record<Connection, string>> = {
  connecting: "connecting",
  streaming: "streaming",
  polling: "polling",
  reconnecting: "reconnecting",
};

/** Seconds since the last live update, refreshed on its own so the page does not re-render. */
function Freshness(props: { receivedAt: number | null }) {
  const [now, setNow] = useState(() => Date.now());
  useEffect(() => {
    const timer = window.setInterval(() => setNow(Date.now()), 1000);
    return () => window.clearInterval(timer);
  }, []);
  if (props.receivedAt === null) return null;
  const seconds = Math.max(0, (now - props.receivedAt) / 1000);
  return (
    <span className="muted">
      updated {seconds < 1.5 ? "just now" : `${seconds.toFixed(0)} s ago`}
    </span>
  );
}

export function ModeBanner(props: {
  replaySeq: number | null;
  replayTs: number | null;
  loading: boolean;
  connection: Connection;
  receivedAt: number | null;
  onLive: () => void;
}) {
  if (props.replaySeq === null) {
    return (
      <div className="mode mode-live" data-testid="mode" data-mode="live" role="status">
        <span
          className={`dot ${props.connection === "streaming" || props.connection === "polling" ? "on" : ""}`}
        />
        <strong>live</strong> <span className="muted">{CONNECTION_TEXT[props.connection]}</span>{" "}
        <Freshness receivedAt={props.receivedAt} />
      </div>
    );
  }
  return (
    <div className="mode mode-replay" data-testid="mode" data-mode="replay" role="status">
      <strong>replay at seq {props.replaySeq}</strong>{" "}
      <span>{props.loading ? "loading…" : formatDateTime(props.replayTs)}</span>
      <button type="button" data-testid="go-live" onClick={props.onLive}>
        Back to live
      </button>
    </div>
  );
}
