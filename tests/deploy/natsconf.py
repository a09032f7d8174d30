"""Read nats-server configuration text and decide subject permissions the way the server does.

The chart writes the NATS users and their permissions as configuration text; the tests parse it
back (objects, arrays, strings, bare words and `$VAR` references, `#` comments) so they can ask
"may this user publish there?" without trusting the template's formatting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r\n]+|\#[^\n]*)
  | (?P<punct>[{}\[\],:=])
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<word>[^\s{}\[\],:="\#]+)
    """,
    re.VERBOSE,
)


def _tokens(text: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(
                f"cannot read NATS configuration at {text[position : position + 30]!r}"
            )
        position = match.end()
        kind = match.lastgroup
        assert kind is not None
        if kind == "space":
            continue
        value = match.group()
        if kind == "string":
            value = bytes(value[1:-1], "utf-8").decode("unicode_escape")
        found.append((kind, value))
    return found


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.at = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise ValueError("NATS configuration ends too early")
        self.at += 1
        return token

    def members(self, closing: str | None) -> dict[str, Any]:
        result: dict[str, Any] = {}
        while True:
            token = self.peek()
            if token is None:
                if closing is not None:
                    raise ValueError(f"missing {closing!r}")
                return result
            if token == ("punct", closing):
                self.at += 1
                return result
            if token == ("punct", ","):
                self.at += 1
                continue
            kind, key = self.take()
            if kind not in ("word", "string"):
                raise ValueError(f"expected a key, found {key!r}")
            if key == "include":
                result.setdefault("include", []).append(self.take()[1])
                continue
            if self.peek() in (("punct", ":"), ("punct", "=")):
                self.at += 1
            result[key] = self.value()

    def value(self) -> Any:
        kind, text = self.take()
        if (kind, text) == ("punct", "{"):
            return self.members("}")
        if (kind, text) == ("punct", "["):
            items: list[Any] = []
            while self.peek() != ("punct", "]"):
                if self.peek() == ("punct", ","):
                    self.at += 1
                    continue
                items.append(self.value())
            self.at += 1
            return items
        if kind == "punct":
            raise ValueError(f"unexpected {text!r}")
        return text


def parse(text: str) -> dict[str, Any]:
    """The configuration as nested dicts and lists; every scalar stays a string."""
    return _Parser(text).members(None)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` is one token, a final `>` is one or more."""
    wanted = pattern.split(".")
    tokens = subject.split(".")
    for index, part in enumerate(wanted):
        if part == ">":
            return index == len(wanted) - 1 and len(tokens) > index
        if index >= len(tokens) or (part != "*" and part != tokens[index]):
            return False
    return len(tokens) == len(wanted)


@dataclass(frozen=True)
class Permissions:
    publish_allow: tuple[str, ...]
    publish_deny: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    subscribe_deny: tuple[str, ...]

    def may_publish(self, subject: str) -> bool:
        return _allowed(subject, self.publish_allow, self.publish_deny)

    def may_subscribe(self, subject: str) -> bool:
        return _allowed(subject, self.subscribe_allow, self.subscribe_deny)


def _allowed(subject: str, allow: tuple[str, ...], deny: tuple[str, ...]) -> bool:
    # As in nats-server: an explicit allow list permits only what it names, and a deny wins.
    permitted = any(subject_matches(p, subject) for p in allow) if allow else True
    return permitted and not any(subject_matches(p, subject) for p in deny)


def _rule(section: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if section is None:
        return (), ()
    if isinstance(section, list):
        return tuple(section), ()
    if isinstance(section, str):
        return (section,), ()
    allow, deny = section.get("allow", []), section.get("deny", [])
    return (
        tuple([allow] if isinstance(allow, str) else allow),
        tuple([deny] if isinstance(deny, str) else deny),
    )


def users(config: dict[str, Any]) -> dict[str, tuple[str, Permissions]]:
    """user name -> (password as written, permissions) from `authorization { users = [...] }`."""
    found: dict[str, tuple[str, Permissions]] = {}
    for entry in config["authorization"]["users"]:
        permissions = entry.get("permissions", {})
        publish_allow, publish_deny = _rule(permissions.get("publish"))
        subscribe_allow, subscribe_deny = _rule(permissions.get("subscribe"))
        found[entry["user"]] = (
            entry["password"],
            Permissions(publish_allow, publish_deny, subscribe_allow, subscribe_deny),
        )
    return found
