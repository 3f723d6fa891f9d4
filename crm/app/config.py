"""The leaderboard app's settings: `HttpLimits`, the bounds of the server's guards against slow,
oversized and hostile clients (crm.app.page's module doc says what each bounds).

Their values and what each means have one home, configs/usl.yaml's `serve` section: crm-usl
composes them there (its schema, crm.cli.usl.ServeConfig, is this dataclass with the model gate's
keys added), and `HttpLimits()` in Python takes its defaults from the same file, read once here.

Plain Python, no Gradio: a command composes and checks its config before loading it
(crm.models.config says why).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from importlib.resources import files

import yaml

_SERVE = yaml.safe_load(files("crm_configs").joinpath("usl.yaml").read_text(encoding="utf-8"))["serve"]


@dataclass(frozen=True)
class HttpLimits:
    read_timeout: float = _SERVE["read_timeout"]
    keep_alive: float = _SERVE["keep_alive"]
    connections: int = _SERVE["connections"]
    per_address: int = _SERVE["per_address"]
    write_timeout: float = _SERVE["write_timeout"]
    max_body: int = _SERVE["max_body"]
    max_upload: int = _SERVE["max_upload"]
    uploads: int = _SERVE["uploads"]
    uploads_per_address: int = _SERVE["uploads_per_address"]
    streams: int = _SERVE["streams"]
    streams_per_address: int = _SERVE["streams_per_address"]
    stream_lifetime: float = _SERVE["stream_lifetime"]
    results: int = _SERVE["results"]
    results_per_address: int = _SERVE["results_per_address"]
    result_age: float = _SERVE["result_age"]
    sessions: int = _SERVE["sessions"]
    sessions_per_address: int = _SERVE["sessions_per_address"]
    session_age: float = _SERVE["session_age"]
    file_age: int = _SERVE["file_age"]
    forwarded_allow_ips: str = _SERVE["forwarded_allow_ips"]

    def __post_init__(self):
        for f in fields(HttpLimits):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value <= 0:
                # a zero limit or timeout would refuse or drop every request
                raise ValueError(f"{f.name}={value}: expected a number > 0")
