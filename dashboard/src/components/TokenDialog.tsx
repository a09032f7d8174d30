import { useState } from "react";
import type { FormEvent } from "react";

/** Asks for the API token once the gateway answers 401; the caller stores it. */
export function TokenDialog(props: { rejected: boolean; onSubmit: (token: string) => void }) {
  const [token, setToken] = useState("");
  const submit = (event: FormEvent) => {
    event.preventDefault();
    if (token.trim()) props.onSubmit(token.trim());
  };
  return (
    <div className="overlay" role="dialog" aria-modal="true" aria-labelledby="token-title">
      <form className="dialog" onSubmit={submit}>
        <h2 id="token-title">API token</h2>
        <p>
          {props.rejected
            ? "The gateway refused the stored token. Enter a valid one."
            : "This gateway needs a token. It is kept in this browser's local storage."}
        </p>
        <input
          type="password"
          autoFocus
          autoComplete="off"
          aria-label="token"
          data-testid="token-input"
          value={token}
          onChange={(event) => setToken(event.target.value)}
        />
        <button type="submit" disabled={!token.trim()}>
          Use token
        </button>
      </form>
    </div>
  );
}
