// HTTP access to the gateway: JSON requests, the SSE stream, and the bearer token when the API
// asks for one (401). The token is asked for once and kept in localStorage.

import type { Dashboard, EventPage, JobList } from "./types";

const TOKEN_KEY = "strata.token";

/** The API answered 401: a token is needed, or the stored one is wrong. */
export class AuthRequired extends Error {
  constructor() {
    super("the API needs a token");
    this.name = "AuthRequired";
  }
}

export class ApiError extends Error {
  readonly status: number;
  /** Seconds to wait before asking again, when the gateway said (a 429: too many replays). */
  readonly retryAfterS: number | null;

  constructor(status: number, message: string, retryAfterS: number | null = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.retryAfterS = retryAfterS;
  }
}

export function storedToken(): string | null {
  try {
    return window.localStorage.getItem(TOKEN_KEY);
  } catch {
    return null;
  }
}

export function storeToken(token: string | null): void {
  try {
    if (token) window.localStorage.setItem(TOKEN_KEY, token);
    else window.localStorage.removeItem(TOKEN_KEY);
  } catch {
    // Private windows may refuse storage; the token then lasts for this page only.
  }
  sessionToken = token;
}

let sessionToken: string | null = storedToken();

function headers(extra?: HeadersInit): Headers {
  const result = new Headers(extra);
  if (sessionToken) result.set("Authorization", `Bearer ${sessionToken}`);
  return result;
}

async function request(path: string, init: RequestInit = {}): Promise<Response> {
  const response = await fetch(path, { ...init, headers: headers(init.headers) });
  if (response.status === 401) throw new AuthRequired();
  if (!response.ok) {
    let detail = response.statusText;
    try {
      const body: unknown = await response.json();
      if (body && typeof body === "object" && "detail" in body) detail = String(body.detail);
      if (body && typeof body === "object" && "code" in body) detail += ` (${String(body.code)})`;
    } catch {
      // Not JSON; the status text will do.
    }
    const retryAfter = Number(response.headers.get("Retry-After"));
    throw new ApiError(
      response.status,
      `${path}: ${response.status} ${detail}`,
      Number.isFinite(retryAfter) && retryAfter > 0 ? retryAfter : null,
    );
  }
  return response;
}

export async function getJson<T>(path: string, signal?: AbortSignal): Promise<T> {
  const response = await request(path, signal ? { signal } : {});
  return (await response.json()) as T;
}

function query(params: Record<string, string | number | undefined>): string {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined) search.set(key, String(value));
  }
  return search.toString();
}

// Paths are relative to the page, so the dashboard works under any sub-path (an ingress that
// serves it at https://host/strata/ and strips the prefix before the gateway).
export const api = {
  jobs: (signal?: AbortSignal) => getJson<JobList>("api/jobs", signal),
  dashboard: (job: string, signal?: AbortSignal) =>
    getJson<Dashboard>(`api/dashboard?${query({ job })}`, signal),
  replay: (job: string, seq: number, signal?: AbortSignal) =>
    getJson<Dashboard>(`api/replay?${query({ job, seq })}`, signal),
  events: (
    job: string,
    options: { afterSeq: number; limit?: number; type?: string },
    signal?: AbortSignal,
  ) =>
    getJson<EventPage>(
      `api/jobs/${encodeURIComponent(job)}/events?${query({
        after_seq: options.afterSeq,
        limit: options.limit,
        type: options.type,
      })}`,
      signal,
    ),
};

/**
 * Read `GET /api/stream?job=` (Server-Sent Events) until it ends, calling `onDashboard` with every
 * `dashboard` event. Read with fetch rather than EventSource, which cannot send a bearer token.
 */
export async function streamDashboard(
  job: string,
  onDashboard: (state: Dashboard) => void,
  signal: AbortSignal,
): Promise<void> {
  const response = await request(`api/stream?${query({ job })}`, {
    signal,
    headers: { Accept: "text/event-stream" },
    cache: "no-store",
  });
  if (!response.body) throw new ApiError(0, "the stream has no body");
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let eventName = "message";
  let data: string[] = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let newline: number;
    while ((newline = buffer.search(/\r\n|\r|\n/)) >= 0) {
      // A lone "\r" at the end may be the first half of a "\r\n" split across chunks.
      if (newline === buffer.length - 1 && buffer.endsWith("\r")) break;
      const line = buffer.slice(0, newline);
      buffer = buffer.slice(newline + (buffer.startsWith("\r\n", newline) ? 2 : 1));
      if (line === "") {
        if (eventName === "dashboard" && data.length > 0) {
          onDashboard(JSON.parse(data.join("\n")) as Dashboard);
        }
        eventName = "message";
        data = [];
      } else if (line.startsWith(":")) {
        // A keepalive comment.
      } else {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const raw = colon < 0 ? "" : line.slice(colon + 1);
        const text = raw.startsWith(" ") ? raw.slice(1) : raw;
        if (field === "event") eventName = text;
        else if (field === "data") data.push(text);
      }
    }
  }
}
