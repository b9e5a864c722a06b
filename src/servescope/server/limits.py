"""ServerLimits: every limit the server puts on what a client may send or hold, in one frozen config.

Each field has a safe default, a `serve` option (generated from the field's metadata, so the CLI,
`serve --help`, docs/SERVER_LIMITS.md and `/v1/internals` cannot drift apart) and is checked where
it is cheapest: the HTTP layer (connections, header and body deadlines, body size, Host, the key)
before any parsing; the request checks (server/request_checks.py) before any tokenising, template
rendering or grammar compiling; the grammar service (server/grammar_service.py) around compiles.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from typing import Optional

MiB = 2**20
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def _lim(default, help: str, flag_type=None, **kw):
    return field(default=default, metadata={"help": help, "type": flag_type, **kw})


@dataclass(frozen=True)
class ServerLimits:
    # admission and request size
    max_queue: int = _lim(
        256, "requests in flight (waiting + running, embeddings too) before new ones get 429"
    )
    max_n: int = _lim(8, "largest n (choices per prompt)")
    max_body_bytes: int = _lim(8 * MiB, "largest request body accepted (413 above)")
    max_prompt_chars: Optional[int] = _lim(
        None,
        "longest prompt text (or sum of a chat's message texts) tokenised; default: the context "
        "length times the longest vocabulary entry, the most that can fit (400 above, before tokenising)",
    )
    max_prompts: int = _lim(256, "prompts per completions request")
    max_embedding_inputs: int = _lim(256, "inputs per embeddings request")
    max_stop_strings: int = _lim(16, "stop strings per request")
    max_stop_string_chars: int = _lim(512, "characters per stop string")
    max_stop_token_ids: int = _lim(128, "stop_token_ids per request")
    max_tools: int = _lim(128, "tool definitions per chat request")
    # structured outputs
    max_grammar_bytes: int = _lim(256 * 1024, "bytes of a JSON schema, regex or grammar")
    max_choices: int = _lim(512, "entries of a structured_outputs.choice")
    max_schema_depth: int = _lim(32, "nesting depth of a JSON schema")
    max_schema_properties: int = _lim(1024, "properties (all objects together) of a JSON schema")
    grammar_compile_timeout_s: float = _lim(
        10.0, "seconds a request waits for its grammar (queue + compile)", float
    )
    grammar_compile_threads: int = _lim(1, "threads that compile grammars (a bounded pool of its own)")
    grammar_compile_queue: int = _lim(16, "grammar compiles waiting or running before new ones get 429")
    grammar_cache_bytes: int = _lim(64 * MiB, "bytes of compiled grammars kept for reuse (oldest evicted)")
    # chat templates
    chat_template_timeout_s: float = _lim(
        5.0, "seconds a chat template may take to render (400 after)", float
    )
    special_tokens_in_content: bool = _lim(
        False,
        "parse control tokens (e.g. <|im_start|>) written in message text as control tokens (default: "
        "they are plain text, so a user cannot inject a role)",
        bool,
    )
    # HTTP
    allowed_hosts: Optional[tuple] = _lim(
        None,
        "Host header values accepted (comma-separated, '*' for any); default: the loopback names for "
        "a loopback bind (DNS rebinding), any otherwise",
        "hosts",
    )
    max_connections: int = _lim(256, "open HTTP connections; more are answered 429 and closed")
    header_timeout_s: float = _lim(10.0, "seconds to receive a request's headers", float)
    body_timeout_s: float = _lim(30.0, "seconds to receive a request's body", float)
    keep_alive_timeout_s: float = _lim(5.0, "seconds an idle keep-alive connection stays open", float)
    max_dashboard_viewers: int = _lim(16, "dashboard viewers connected at once (429 beyond)")
    max_internals_steps: int = _lim(10_000, "step records one /v1/internals answer may hold (its n)")
    metrics_public: bool = _lim(False, "serve /metrics without the API key (for a scraper without one)", bool)
    dashboard_previews: Optional[bool] = _lim(
        None,
        "show prompt previews on the dashboard; default: only behind --api-key (every viewer "
        "then holds the key)",
        bool,
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or isinstance(v, (bool, tuple)):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{f.name} must be a positive number, got {v!r}")
        if self.allowed_hosts is not None:
            hosts = tuple(str(h).strip().lower() for h in self.allowed_hosts if str(h).strip())
            if not hosts:
                raise ValueError("allowed_hosts is empty (use '*' to accept any Host)")
            object.__setattr__(self, "allowed_hosts", hosts)

    def for_bind(self, bind_host: str) -> "ServerLimits":
        """The limits with allowed_hosts resolved for a server bound to bind_host."""
        if self.allowed_hosts is not None:
            return self
        return dataclasses.replace(self, allowed_hosts=LOOPBACK_HOSTS if is_loopback(bind_host) else ("*",))

    def host_allowed(self, host_header: str) -> bool:
        """Whether a Host header (name[:port]) is on the allow-list (None: the loopback names)."""
        hosts = self.allowed_hosts if self.allowed_hosts is not None else LOOPBACK_HOSTS
        if "*" in hosts:
            return True
        name = host_header.strip().lower()
        if name.startswith("["):  # [v6]:port
            name = name[1 : name.find("]")] if "]" in name else name
        elif name.count(":") == 1:
            name = name.rsplit(":", 1)[0]
        return name in hosts or name.rstrip(".") in hosts

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["allowed_hosts"] = list(self.allowed_hosts) if self.allowed_hosts is not None else None
        return d


def limits_table() -> str:
    """The limits as a Markdown table (docs/SERVER_LIMITS.md holds it; a test keeps the two equal)."""
    rows = ["| option | default | what it limits |", "| --- | --- | --- |"]
    for f in dataclasses.fields(ServerLimits):
        default = f.default
        shown = (
            "derived"
            if default is None
            else (
                f"{default} ({default // MiB} MiB)"
                if isinstance(default, int) and not isinstance(default, bool) and default >= MiB
                else str(default)
            )
        )
        rows.append(f"| `{_flag(f.name)}` | {shown} | {f.metadata['help'].replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_hosts(text: str) -> tuple:
    return tuple(h.strip() for h in text.split(",") if h.strip())


def add_limit_args(parser) -> None:
    """One `serve` option per ServerLimits field, its help and default from the field."""
    defaults = ServerLimits()
    g = parser.add_argument_group("limits (docs/SERVER_LIMITS.md)")
    for f in dataclasses.fields(ServerLimits):
        kind, default = f.metadata.get("type"), getattr(defaults, f.name)
        shown = f" (default {default})" if default is not None else ""
        if kind is bool:
            g.add_argument(
                _flag(f.name), dest=f.name, default=None, action=BoolFlag, help=f"{f.metadata['help']}{shown}"
            )
        elif kind == "hosts":
            g.add_argument(
                _flag(f.name),
                dest=f.name,
                default=None,
                type=_parse_hosts,
                metavar="HOST,...",
                help=f.metadata["help"],
            )
        else:
            g.add_argument(
                _flag(f.name),
                dest=f.name,
                default=None,
                type=_positive(kind or int),
                metavar="S" if kind is float else "N",
                help=f"{f.metadata['help']}{shown}",
            )


def limits_from_args(args) -> ServerLimits:
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ServerLimits)
        if getattr(args, f.name, None) is not None
    }
    return ServerLimits(**given)


def _positive(kind):
    def parse(text: str):
        import argparse  # lazy: only while parsing a command line

        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return v

    return parse


class BoolFlag:
    """`--flag` / `--flag true|false` (argparse.Action; defined without importing argparse here)."""

    def __new__(cls, option_strings, dest, **kw):
        import argparse  # lazy: only while building a command line parser

        class _Action(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None):
                text = "true" if values is None else str(values).lower()
                if text not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    parser.error(f"{option_string} takes true or false, got {values!r}")
                setattr(namespace, self.dest, text in ("true", "1", "yes", "on"))

        return _Action(option_strings, dest, nargs="?", metavar="BOOL", **kw)
