"""Live progress of a training peer: a status line on a terminal, log lines otherwise, JSON-lines metrics file."""

from __future__ import annotations

import json
import logging
import time
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from hivetrain.config import RunConfig

logger = logging.getLogger("hivetrain.progress")


class ProgressReporter:
    """Receives trainer events (dicts with an ``event`` key) and shows/records them."""

    def __init__(self, metrics_path: str | None, interactive: bool, config: RunConfig):
        self.config = config
        self._file: IO[str] | None = open(metrics_path, "a", buffering=1) if metrics_path else None  # noqa: SIM115
        self._live: Live | None = None
        if interactive:
            self._live = Live(Text("starting..."), console=Console(stderr=True), refresh_per_second=4, transient=False)
            self._live.start()
        self._tokens_per_s = 0.0
        self._eval = None
        self._last_line = 0.0

    def event(self, event: dict) -> None:
        kind = event["event"]
        if kind != "inner_step" and self._file is not None:
            self._file.write(json.dumps(event) + "\n")
        if kind == "inner_phase":
            self._tokens_per_s = event.get("tokens_per_s", 0.0)
        if event.get("eval_loss") is not None:
            self._eval = event["eval_loss"]
        if self._live is not None:
            self._live.update(self._status(event))
        elif kind not in ("inner_step",):
            logger.info("%s", self._plain(event))

    def _status(self, event: dict) -> Text:
        h = self.config.diloco.inner_steps
        step = event.get("inner_step", event["epoch"] * h)
        next_outer = (event["epoch"] + 1) * h - step if event["event"] == "inner_step" else 0
        loss = event.get("loss")
        return Text.assemble(
            ("epoch ", "dim"),
            (f"{event['epoch']}", "bold"),
            ("  inner step ", "dim"),
            f"{step}",
            ("  loss ", "dim"),
            f"{loss:.3f}" if loss is not None else "-",
            ("  eval ", "dim"),
            f"{self._eval:.3f}" if self._eval is not None else "-",
            ("  tokens/s ", "dim"),
            f"{self._tokens_per_s:,.0f}",
            ("  peers ", "dim"),
            f"{event.get('peers_seen', 0)}",
            ("  next outer step in ", "dim"),
            f"{next_outer} steps",
            ("  last: ", "dim"),
            event["event"],
        )

    def _plain(self, event: dict) -> str:
        skip = {"event", "time", "peer", "state_hash"}
        fields = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in event.items()
            if k not in skip and v is not None
        )
        return f"{event['event']}: {fields}"

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._file is not None:
            self._file.close()
            self._file = None
        self._last_line = time.time()
