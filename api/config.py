"""ApiConfig: the API process's options and their command line (`api/server.py ...`).

Rank 0 builds an ApiConfig and starts the API process with
`subprocess.Popen([*checkout_entry("api/server.py"), *config.to_argv()])`; the process
rebuilds the same ApiConfig with `ApiConfig.from_argv(sys.argv[1:])`. The API key never
appears on the command line: `to_argv()` writes it to `{ipc_dir}/api_key` (mode 0600, inside
the private 0700 ipc dir) and passes `--api-key-file`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

from tapserve.api.sampling_params import MODEL_DEFAULT_FIELDS

KEY_FILE = "api_key"


def http_url(host: str, port: int) -> str:
    """The server's address as a URL (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class ApiConfig:
    ipc_dir: str  # the coordinator's private dir holding the to_engine / from_engine sockets
    tokenizer: str  # folder with tokenizer.json (+ tokenizer_config.json, chat_template.jinja)
    served_model_name: str = "tapserve"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int = 2048  # the engine's context length (prompt + output tokens)
    eos_token_ids: tuple[int, ...] = ()  # the engine's: a sequence ends on one (not ignore_eos)
    # the model's vocabulary, which a checkpoint may pad past the tokenizer's (ids the model
    # can sample; 0: the tokenizer's)
    model_vocab_size: int = 0
    max_num_seqs: int = 256  # the engine's running-request limit
    max_queued_requests: int = 1024  # engine requests beyond max_num_seqs before 503
    chat_template: str | None = None  # file (or inline template) overriding the tokenizer's
    # special-token text inside chat message content tokenizes as plain text (by default, as
    # vLLM's, it is the special token); the template's own special tokens stay special
    split_special_tokens_in_messages: bool = False
    # the custom head's labels (its handler's `labels`, checked at start-up): one name for a
    # [rows] output, one per column of a [rows, width] one; None: it declares none
    custom_output_labels: str | list[str] | None = None
    # "name=value" sampling defaults for fields a request leaves out (generation_config.json)
    sampling_defaults: tuple[str, ...] = ()
    log_requests: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    max_n: int = 16  # per-request cap on n / num_return_sequences / num_beams
    max_tokens: int | None = None  # per-request cap on max_tokens (None: max_model_len)
    max_prompts: int = 1024  # prompts per request (completions list, /custom_output batch)
    parent_pid: int | None = None  # exit when this process is gone (None: the spawner)
    health_timeout_s: float = 10.0  # /health fails when the engine is silent this long
    engine_timeout_s: float = 300.0  # in-flight requests fail (503) after this much silence
    graceful_timeout_s: float = 5.0  # uvicorn's wait for open connections at exit
    log_level: str = "info"

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def __post_init__(self) -> None:
        checks = [
            ("port", 0 <= self.port < 65536),
            ("max_model_len", self.max_model_len >= 2),
            ("max_num_seqs", self.max_num_seqs >= 1),
            ("max_queued_requests", self.max_queued_requests >= 0),
            ("max_body_bytes", self.max_body_bytes >= 1024),
            ("max_n", self.max_n >= 1),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 0),
            ("max_prompts", self.max_prompts >= 1),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"ApiConfig.{name} is out of range: {getattr(self, name)!r}")
        _ = self.default_sampling  # a malformed entry fails here, not in a request

    @cached_property
    def default_sampling(self) -> dict[str, float | int]:
        """sampling_defaults as SamplingParams keyword arguments (parsed once: every
        request's SamplingParams starts from them)."""
        out: dict[str, float | int] = {}
        for entry in self.sampling_defaults:
            name, _, value = entry.partition("=")
            if name not in MODEL_DEFAULT_FIELDS:
                raise ValueError(f"ApiConfig.sampling_defaults: unknown field in {entry!r}")
            out[name] = MODEL_DEFAULT_FIELDS[name](value)
        return out

    @property
    def max_in_flight(self) -> int:
        """Engine requests the API lets in at once; more get 503."""
        return self.max_num_seqs + self.max_queued_requests

    @property
    def max_tokens_limit(self) -> int:
        return (
            self.max_model_len
            if self.max_tokens is None
            else min(self.max_tokens, self.max_model_len)
        )

    def to_argv(self) -> list[str]:
        """Command-line arguments for `api/server.py` (writes the API key file)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if f.name == "api_key":
                if value:
                    argv += ["--api-key-file", self._write_key_file(value)]
            elif f.name == "custom_output_labels":  # (JSON: a label may hold a comma)
                argv += [f"{flag}={json.dumps(value)}"] if value is not None else []
            elif isinstance(value, bool):
                argv += [flag] if value else []
            elif isinstance(value, tuple):  # (flag=value: a value may start with "-")
                argv += [f"{flag}={','.join(map(str, value))}"] if value else []
            elif value is not None:
                argv += [f"{flag}={value}"]
        return argv

    def _write_key_file(self, key: str) -> str:
        os.makedirs(self.ipc_dir, mode=0o700, exist_ok=True)
        path = os.path.join(self.ipc_dir, KEY_FILE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(key)
        return path

    @classmethod
    def from_argv(cls, argv: list[str]) -> ApiConfig:
        args = vars(_parser().parse_args(argv))
        key_file = args.pop("api_key_file")
        if key_file:
            # ASCII whitespace only, as the gate strips the header's bytes (a key may end in
            # a no-break space)
            args["api_key"] = Path(key_file).read_text(encoding="utf-8").strip(" \t\n\r\x0b\x0c")
        args["api_key"] = args["api_key"] or os.environ.get("TAPSERVE_API_KEY") or None
        return cls(**args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="api/server.py", description="tapserve API process (started by rank 0)"
    )
    defaults = {f.name: f.default for f in fields(ApiConfig)}
    p.add_argument("--ipc-dir", required=True)
    p.add_argument("--tokenizer", required=True)
    for name in ("served_model_name", "host", "chat_template", "log_level"):
        p.add_argument("--" + name.replace("_", "-"), default=defaults[name])
    for name in (
        "port",
        "max_model_len",
        "max_num_seqs",
        "max_queued_requests",
        "max_body_bytes",
        "max_n",
        "max_prompts",
        "model_vocab_size",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name])
    for name in ("max_tokens", "parent_pid"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    for name in ("health_timeout_s", "engine_timeout_s", "graceful_timeout_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=defaults[name])
    p.add_argument(
        "--eos-token-ids", default=(), type=lambda text: tuple(int(t) for t in text.split(",") if t)
    )
    p.add_argument(
        "--sampling-defaults", default=(), type=lambda text: tuple(t for t in text.split(",") if t)
    )
    p.add_argument("--log-requests", action="store_true")
    p.add_argument("--split-special-tokens-in-messages", action="store_true")
    p.add_argument("--custom-output-labels", type=json.loads, default=None)
    p.add_argument("--api-key", default=None, help="prefer --api-key-file or $TAPSERVE_API_KEY")
    p.add_argument("--api-key-file", default=None)
    return p
