import type { ReactNode } from "react";

export function Panel(props: {
  title: string;
  subtitle?: ReactNode;
  actions?: ReactNode;
  className?: string;
  testId?: string;
  children: ReactNode;
}) {
  return (
    <section
      className={`panel ${props.className ?? ""}`}
      aria-label={props.title}
      data-testid={props.testId}
    >
      <header className="panel-head">
        <h2>{props.title}</h2>
        {props.subtitle !== undefined && <span className="panel-sub">{props.subtitle}</span>}
        {props.actions !== undefined && <div className="panel-actions">{props.actions}</div>}
      </header>
      {props.children}
    </section>
  );
}

export function Empty(props: { children: ReactNode }) {
  return <p className="empty">{props.children}</p>;
}
