"""The coordinator's live dashboard: a FastAPI app served by uvicorn on a background thread.

Routes (all read-only, GET):

    /                 server-rendered HTML (Jinja2, autoescaped): run, stats, loss chart (inline SVG), peers,
                      contributors, averaging rounds, checkpoints, config; a small inline script polls
                      /api/fragments every ``refresh_interval_s`` and swaps the sections that changed (no reload)
    /api/status       the whole snapshot as JSON
    /api/peers        ?limit=1..1000 (default 100) &offset=0..1e9: a page of peers, with the total
                      (peers that left, with why, are in /api/status ``peers_left`` and on the page)
    /api/rounds       ?limit=1..1000 (default 50): the newest rounds
    /api/pipeline     a pipelined run's stages (servers with throughput and load), trainers (credited
                      microbatches, reroutes, replays), microbatches/s and rebalances with reasons; 404 for a
                      data-parallel run (also in /api/status ``pipeline``)
    /api/fragments    {"sections": {element id: html}} for the polling script
    /metrics          Prometheus text (per-server CollectorRegistry, see ``metrics.py``)
    /healthz          {"ok": true}

Bad query values are answered 422 (FastAPI validation), unknown query parameters 400. Nothing secret is served:
the run config reaches the page only through ``summarize_config`` (see ``web/snapshot.py``). The HTML carries a
strict Content-Security-Policy: only its own nonce'd script runs, so a hostile volunteer name cannot inject one.

``snapshot_fn`` is called from the server's worker threads (at most once per ``snapshot_ttl_s``); it must be
thread-safe and fast (copy the coordinator's state under its lock, do no network I/O).
"""

from __future__ import annotations

import logging
import math
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from hivetrain.coordinator.metrics import build_registry, render_metrics
from hivetrain.coordinator.web.chart import render_loss_svg
from hivetrain.coordinator.web.pipeline_view import PipelineView
from hivetrain.coordinator.web.snapshot import (
    CheckpointRow,
    ContributorRow,
    DashboardSnapshot,
    DriftPoint,
    LeftPeerRow,
    LossPoint,
    PeerRow,
    RoundRow,
    RunInfo,
    short_peer_id,
    summarize_config,
    to_jsonable,
)

__all__ = [
    "CheckpointRow",
    "ContributorRow",
    "DashboardConfig",
    "DashboardServer",
    "DashboardSnapshot",
    "DriftPoint",
    "LeftPeerRow",
    "LossPoint",
    "PeerRow",
    "RoundRow",
    "RunInfo",
    "create_app",
    "summarize_config",
]

logger = logging.getLogger(__name__)

_TEMPLATES = Path(__file__).parent / "web" / "templates"
_SECTIONS = (
    "header",
    "stats",
    "pipeline",
    "chart",
    "peers",
    "peers_left",
    "contributors",
    "rounds",
    "checkpoints",
    "config",
)
_CSP = (
    "default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_API_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


@dataclass(frozen=True)
class DashboardConfig:
    """Dashboard settings.

    Args:
        host: interface to bind ("127.0.0.1" = this machine only, "0.0.0.0" = public).
        port: TCP port; 0 = any free port (read ``DashboardServer.port`` after ``start``).
        refresh_interval_s: how often the page polls for updates, seconds.
        snapshot_ttl_s: a snapshot is reused for this long, seconds (bounds the load many viewers put on the
            coordinator); must not exceed ``refresh_interval_s``.
        page_max_rows: peers and contributors listed on the page (the API pages through all).
        page_max_rounds: rounds and checkpoints listed on the page.
        peer_alive_within_s: a peer seen within this many seconds counts as alive.
    """

    host: str = "127.0.0.1"
    port: int = 0
    refresh_interval_s: float = 3.0
    snapshot_ttl_s: float = 1.0
    page_max_rows: int = 50
    page_max_rounds: int = 15
    peer_alive_within_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0.2 <= self.refresh_interval_s <= 3600:
            raise ValueError(f"refresh_interval_s must be in [0.2, 3600], got {self.refresh_interval_s}")
        if not 0 <= self.snapshot_ttl_s <= self.refresh_interval_s:
            raise ValueError(
                f"snapshot_ttl_s ({self.snapshot_ttl_s}) must be in [0, refresh_interval_s ({self.refresh_interval_s})]"
            )
        if self.page_max_rows < 1 or self.page_max_rounds < 1 or self.peer_alive_within_s <= 0:
            raise ValueError("page_max_rows, page_max_rounds and peer_alive_within_s must be positive")


class _SnapshotCache:
    """Calls ``fn`` at most once per ``ttl_s``; thread-safe. Errors are not cached."""

    def __init__(self, fn: Callable[[], DashboardSnapshot], ttl_s: float) -> None:
        self._fn, self._ttl_s = fn, ttl_s
        self._lock = threading.Lock()
        self._value: DashboardSnapshot | None = None
        self._taken = -math.inf

    def get(self) -> DashboardSnapshot:
        with self._lock:
            if time.monotonic() - self._taken >= self._ttl_s or self._value is None:
                value = self._fn()
                if not isinstance(value, DashboardSnapshot):
                    raise TypeError(f"snapshot_fn returned {type(value).__name__}, not DashboardSnapshot")
                self._value, self._taken = value, time.monotonic()
            return self._value


@dataclass(frozen=True)
class PageView:
    """What the templates render: the snapshot plus display settings and derived values."""

    snap: DashboardSnapshot
    now: float
    chart_svg: str
    peers_alive: int
    loss_delta: float | None
    alive_within_s: float
    refresh_interval_s: float
    max_rows: int
    max_rounds: int

    def share(self, contributor: ContributorRow) -> float:
        """The contributor's samples as a percentage of the top contributor's (for the bar): witnessed samples, or
        claimed ones in a run without witnesses (moshpit/gossip)."""
        witnessed = self.snap.samples_credited_total > 0
        value = (lambda c: c.samples_credited) if witnessed else (lambda c: c.samples_contributed)  # noqa: E731
        top = max((value(c) for c in self.snap.contributors), default=0)
        return round(100.0 * value(contributor) / top, 1) if top else 0.0


def _page_view(snap: DashboardSnapshot, config: DashboardConfig) -> PageView:
    finite = [p for p in snap.loss_curve if math.isfinite(p.eval_loss)]
    return PageView(
        snap=snap,
        now=snap.taken_at or time.time(),
        chart_svg=render_loss_svg(snap.loss_curve),
        peers_alive=snap.num_peers_alive(config.peer_alive_within_s),
        loss_delta=finite[-1].eval_loss - finite[-2].eval_loss if len(finite) >= 2 else None,
        alive_within_s=config.peer_alive_within_s,
        refresh_interval_s=config.refresh_interval_s,
        max_rows=config.page_max_rows,
        max_rounds=config.page_max_rounds,
    )


def _ago(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _si(value: float) -> str:
    for threshold, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.3g}{suffix}"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(_TEMPLATES),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        ago=_ago,
        si=_si,
        short_id=short_peer_id,
        hours=lambda s: f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min",
        utc=lambda t: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "–",
    )
    return env


def _only_params(request: Request, *allowed: str) -> None:
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise HTTPException(status_code=400, detail=f"unknown query parameter(s) {unknown}; allowed: {list(allowed)}")


def _pipeline_json(view: PipelineView) -> dict[str, Any]:
    """The pipeline view as JSON, with its derived figures (servers in all, each stage's mean load)."""
    body = to_jsonable(view)
    body["num_servers"] = view.num_servers
    for row, stage in zip(body["stages"], view.stages, strict=True):
        row["mean_load"] = stage.mean_load
    return body


def create_app(snapshot_fn: Callable[[], DashboardSnapshot], config: DashboardConfig) -> tuple[FastAPI, Any]:
    """The dashboard's FastAPI app and its Prometheus registry (handlers are sync: FastAPI runs them in threads)."""
    cache = _SnapshotCache(snapshot_fn, config.snapshot_ttl_s)
    registry = build_registry(cache.get, config.peer_alive_within_s)
    env = _environment()
    sections = env.get_template("sections.html").module
    app = FastAPI(title="hivetrain coordinator", docs_url=None, redoc_url=None, openapi_url=None)

    def snapshot() -> DashboardSnapshot:
        try:
            return cache.get()
        except Exception as exc:  # noqa: BLE001 - the coordinator's failure is shown, not propagated
            logger.exception("dashboard: snapshot failed")
            raise HTTPException(status_code=503, detail="the coordinator could not produce a snapshot") from exc

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        _only_params(request)
        nonce = secrets.token_urlsafe(16)
        html = env.get_template("index.html").render(v=_page_view(snapshot(), config), nonce=nonce)
        headers = {
            **_API_HEADERS,
            "Content-Security-Policy": _CSP.format(nonce=nonce),
            "Referrer-Policy": "no-referrer",
        }
        return HTMLResponse(html, headers=headers)

    @app.get("/api/fragments")
    def fragments(request: Request) -> JSONResponse:
        _only_params(request)
        view = _page_view(snapshot(), config)
        html = {f"sec-{name}": str(getattr(sections, name)(view)) for name in _SECTIONS}
        return JSONResponse({"taken_at": view.now, "sections": html}, headers=_API_HEADERS)

    @app.get("/api/status")
    def status(request: Request) -> JSONResponse:
        _only_params(request)
        snap = snapshot()
        body = to_jsonable(snap)
        latest = snap.latest_loss()
        body.update(
            num_peers_alive=snap.num_peers_alive(config.peer_alive_within_s),
            samples_contributed_total=snap.samples_contributed_total,
            samples_credited_total=snap.samples_credited_total,
            compute_s_total=snap.compute_s_total,
            latest_eval_loss=None if latest is None else latest.eval_loss,
        )
        if snap.pipeline is not None:
            body["pipeline"] = _pipeline_json(snap.pipeline)
        return JSONResponse(body, headers=_API_HEADERS)

    @app.get("/api/peers")
    def peers(
        request: Request,
        limit: int = Query(100, ge=1, le=1000, description="peers per page"),
        offset: int = Query(0, ge=0, le=1_000_000_000, description="peers to skip"),
    ) -> JSONResponse:
        _only_params(request, "limit", "offset")
        rows = snapshot().peers
        body = {
            "total": len(rows),
            "limit": limit,
            "offset": offset,
            "peers": to_jsonable(rows[offset : offset + limit]),
        }
        return JSONResponse(body, headers=_API_HEADERS)

    @app.get("/api/rounds")
    def rounds(request: Request, limit: int = Query(50, ge=1, le=1000, description="newest rounds")) -> JSONResponse:
        _only_params(request, "limit")
        rows = snapshot().rounds
        return JSONResponse(
            {"total": len(rows), "limit": limit, "rounds": to_jsonable(rows[:limit])}, headers=_API_HEADERS
        )

    @app.get("/api/pipeline")
    def pipeline(request: Request) -> JSONResponse:
        _only_params(request)
        view = snapshot().pipeline
        if view is None:
            raise HTTPException(status_code=404, detail="this run is not pipelined (no [swarm] table)")
        return JSONResponse(_pipeline_json(view), headers=_API_HEADERS)

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        _only_params(request)
        body, content_type = render_metrics(registry)
        return Response(body, media_type=content_type, headers=_API_HEADERS)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        return JSONResponse({"ok": True}, headers=_API_HEADERS)

    return app, registry


class DashboardServer:
    """Serves the dashboard from a daemon thread. Lifecycle: ``start()``, ``wait_ready(timeout_s)``,
    ``shutdown(timeout_s)``; also a context manager (start + wait_ready(10 s) / shutdown).

    Args:
        snapshot_fn: returns the current ``DashboardSnapshot``; thread-safe and fast (see module docstring).
        host, port: where to listen; port 0 = a free port, read ``.port`` after ``start()``.
        **settings: the other ``DashboardConfig`` fields (``refresh_interval_s``, ``snapshot_ttl_s``, ...).

    Raises:
        ValueError: invalid settings (from ``DashboardConfig``).
    """

    def __init__(
        self, snapshot_fn: Callable[[], DashboardSnapshot], host: str = "127.0.0.1", port: int = 0, **settings: Any
    ) -> None:
        self.config = DashboardConfig(host=host, port=port, **settings)
        self.app, self.registry = create_app(snapshot_fn, self.config)
        self._socket: socket.socket | None = None
        self._port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound TCP port. Raises RuntimeError before ``start()``."""
        if self._port is None:
            raise RuntimeError("DashboardServer.port is known only after start()")
        return self._port

    @property
    def url(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/"

    def start(self) -> None:
        """Bind the port (so ``.port`` is known at once) and start serving on a daemon thread.

        Raises:
            RuntimeError: already started.
            OSError: the port cannot be bound (e.g. in use).
        """
        if self._thread is not None:
            raise RuntimeError("DashboardServer already started")
        family, kind, proto, _, address = socket.getaddrinfo(
            self.config.host, self.config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        self._socket, self._port = sock, sock.getsockname()[1]
        uv_config = uvicorn.Config(
            self.app,
            log_level="warning",
            log_config=None,  # leave the host process's logging alone (uvicorn's dictConfig silenced our loggers)
            access_log=False,
            lifespan="off",
            loop="asyncio",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="hivetrain-dashboard", daemon=True
        )
        self._thread.start()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the server accepts connections.

        Raises:
            RuntimeError: not started, or the server thread died during startup.
            TimeoutError: not ready within ``timeout_s`` seconds.
        """
        if self._server is None or self._thread is None:
            raise RuntimeError("call start() first")
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("dashboard server thread exited during startup (see the log)")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"dashboard not ready within {timeout_s} s")
            time.sleep(0.01)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop serving: graceful (finish in-flight requests) for up to ``timeout_s``, then forced. Idempotent."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(1.0)
            if self._thread.is_alive():
                logger.error("dashboard thread did not stop within %.1f s (daemon thread left behind)", timeout_s + 1)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def __enter__(self) -> DashboardServer:
        self.start()
        try:
            self.wait_ready(timeout_s=10.0)
        except BaseException:
            self.shutdown()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
