"""The lab's FastAPI app: the page, its static files, and the JSON API behind every chart.

`servelab lab` serves it on its own; `servelab serve` mounts it at `/lab` and passes
`engine_metrics_source`, a callable that returns the running engine's own figures (see
`servelab.lab.live`), which feeds the live engine panel, and, with `--profile`, a calibrated
profile whose simulator prediction the "your machine" panel overlays on what the page measured
(see `servelab.lab.your_machine`).
"""

from __future__ import annotations

import importlib
import importlib.resources
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from servelab.errors import InvalidArgument, NotFound, ServelabError
from servelab.lab.limits import RETRY_AFTER_S
from servelab.lab.live import EngineMetricsSource, read_engine_stats
from servelab.lab.params import Params

if TYPE_CHECKING:
    from servelab.lab.calibration_job import CalibrationRunner
    from servelab.lab.simulations import Simulations

_STATIC_FILES = {"lab.js": "text/javascript", "lab.css": "text/css"}


def plotly_js_path() -> Path:
    """plotly.js as bundled inside the `plotly` Python package: the lab works offline and the
    repository does not carry a 4 MB copy of it."""
    path = Path(str(importlib.resources.files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise RuntimeError(f"plotly.min.js not found at {path}; reinstall the 'plotly' package")
    return path


def _static_dir() -> Path:
    return Path(str(importlib.resources.files("servelab.lab") / "static"))


def _error_response(exc: ServelabError) -> JSONResponse:
    from servelab.server.http_errors import error_json  # the server's error shape, code included

    body = error_json(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.http_status == 429 else None  # plans and replays alike
    return JSONResponse(body, status_code=exc.http_status, headers=headers)


def server_root_url(request: Request) -> str:
    """The server the lab is mounted in: the page sends its load to ../v1 from the lab's root, so
    the server's root is the parent of the lab's mount. Its address is the socket's the request
    came in on, not the Host header, which the client writes: calibration sends minutes of load,
    with the caller's key, and must send them nowhere but here."""
    lab_root = request.url.path.rsplit("/api/", 1)[0]
    server = request.scope.get("server")
    if server is None:
        raise InvalidArgument("the lab cannot tell which address this server listens on", param="base_url")
    host, port = server
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != {"http": 80, "https": 443}.get(request.url.scheme):
        netloc += f":{port}"
    return f"{request.url.scheme}://{netloc}{lab_root.rsplit('/', 1)[0]}"


def _import_simulator_in_background() -> None:
    """The simulated lessons import the scheduler, the simulator and numpy-heavy metrics (0.6 s of
    CPU on the development host): start that while the page loads, so the first simulated lesson
    does not pay it. A lesson asked for sooner waits on the same import, no longer."""
    threading.Thread(
        target=importlib.import_module, args=("servelab.lab.seed_lessons",), name="lab-imports", daemon=True
    ).start()


def create_lab_app(
    engine_metrics_source: EngineMetricsSource | None = None,
    *,
    profile: dict[str, Any] | None = None,
    profile_path: str | None = None,
    served_model: Callable[[], str | None] | None = None,
    max_request_bytes: int | None = None,
    allowed_hosts: frozenset[str] | None = None,
    simulations: Simulations | None = None,
    calibration: CalibrationRunner | None = None,
) -> FastAPI:
    """The lab as an ASGI app. Mount it anywhere (`app.mount("/lab", create_lab_app(...))`): the
    page addresses its API and files by relative URLs. `profile` is a loaded `servelab calibrate`
    profile (`servelab.cost.profile.load_profile`); `served_model` names the engine's model.
    `max_request_bytes`, for the lab served on its own (`servelab lab`), puts `servelab serve`'s
    own request guard in front of it (a JSON Content-Type on a POST, the body limit, the Host
    check against `allowed_hosts`); mounted in `servelab serve`, the server's guard already covers
    it. `simulations` (default: the lab's own, with the default budgets) runs the simulator
    lessons; `calibration` (default: `servelab calibrate --base-url` in a subprocess) runs the
    "your machine" panel's background calibration. `app.state.stop()`, for a stopping server,
    ends the running simulations, capacity plans and calibration within milliseconds and refuses
    new ones (503).

    A lesson is a POST with its inputs as a JSON object: a simulation takes seconds of CPU, and a
    JSON POST is what another site's page cannot send without the CORS preflight this server
    never grants."""
    from servelab.lab import api  # the lesson registry imports the cost model; keep app import cheap
    from servelab.lab.calibration_job import CalibrationRunner
    from servelab.lab.capacity_lesson import CapacityPlanner
    from servelab.lab.simulations import Simulations
    from servelab.lab.your_machine import Predictor

    def metrics_text() -> str:
        raw = engine_metrics_source() if engine_metrics_source is not None else ""
        return raw if isinstance(raw, str) else ""

    app = FastAPI(title="servelab lab", docs_url=None, redoc_url=None, openapi_url=None)
    if max_request_bytes is not None:
        from servelab.server.guards import RequestGuard

        app.add_middleware(RequestGuard, api_key=None, max_request_bytes=max_request_bytes, allowed_hosts=allowed_hosts)
    app.state.engine_metrics_source = engine_metrics_source
    app.state.capacity_planner = CapacityPlanner()
    app.state.simulations = simulations or Simulations()
    _import_simulator_in_background()

    app.state.predictor = Predictor(
        profile, profile_path, metrics_text if engine_metrics_source else None, served_model
    )
    app.state.calibration = calibration or CalibrationRunner(app.state.predictor.set_profile)

    def stop() -> None:
        # Called from a signal handler: each only sets flags and signals processes.
        app.state.simulations.cancel()
        app.state.capacity_planner.close()
        app.state.calibration.stop()

    app.state.stop = stop

    @app.exception_handler(ServelabError)
    async def _servelab_error(_: Request, exc: ServelabError) -> JSONResponse:
        return _error_response(exc)

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> Response:
        # Relative URLs only resolve under the mount when the page's own URL ends in a slash.
        if not request.url.path.endswith("/"):
            return Response(status_code=307, headers={"location": request.url.path + "/"})
        html = (_static_dir() / "index.html").read_text(encoding="utf-8")
        return HTMLResponse(html)

    @app.get("/static/plotly.min.js")
    def plotly_js() -> FileResponse:
        return FileResponse(plotly_js_path(), media_type="text/javascript")

    @app.get("/static/{name}")
    def static(name: str) -> FileResponse:
        if name not in _STATIC_FILES:
            raise NotFound(f"static file {name!r} does not exist")
        return FileResponse(_static_dir() / name, media_type=_STATIC_FILES[name])

    @app.get("/api/catalog")
    def catalog() -> dict[str, Any]:
        return api.catalog()

    @app.post("/api/lessons/{name}")
    async def lesson(name: str, request: Request) -> Any:
        from starlette.concurrency import run_in_threadpool

        from servelab.server.http_errors import decode_json_object

        params = Params(decode_json_object(await request.body()))
        # A dict, or a ready response (the capacity plan answers 202 while it runs).
        return await run_in_threadpool(api.run_lesson, name, params, app.state.capacity_planner,
                                       app.state.simulations, app.state.engine_metrics_source)  # fmt: skip

    @app.get("/api/lessons/{name}")
    def lesson_get(name: str) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": f"a lesson is a POST with its inputs as a JSON object: POST /api/lessons/{name} "
                                  "with 'Content-Type: application/json'", "type": "invalid_request_error",
                       "param": None, "code": 405}},
            status_code=405, headers={"Allow": "POST"})  # fmt: skip

    @app.get("/api/live")
    def live() -> dict[str, Any]:
        source: Callable[[], Any] | None = app.state.engine_metrics_source
        if source is None:
            raise NotFound("no engine here: the live view works when the lab runs inside `servelab serve` (at /lab)")
        return read_engine_stats(source)

    @app.get("/api/live/setup")
    def live_setup() -> dict[str, Any]:
        return app.state.predictor.describe()

    @app.get("/api/live/calibrate")
    def calibrate_status() -> dict[str, Any]:
        return app.state.calibration.status()

    @app.post("/api/live/calibrate", status_code=202)
    def calibrate_start(request: Request) -> dict[str, Any]:
        """Starts `servelab calibrate --base-url` against this server in the background (the
        GET reports its progress); the profile it writes is loaded into the panel."""
        if app.state.engine_metrics_source is None:
            raise NotFound(
                "no engine here: calibrating measures the server the lab runs in, which needs `servelab serve`"
            )
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        api_key = token.strip() if scheme.lower() == "bearer" else None
        served = served_model() if served_model is not None else None
        return app.state.calibration.start(server_root_url(request), api_key, served)

    @app.post("/api/live/predict")
    async def live_predict(request: Request) -> dict[str, Any]:
        from starlette.concurrency import run_in_threadpool

        from servelab.server.http_errors import decode_json_object  # the server's 400s, one source of truth

        raw = await request.body()
        return await run_in_threadpool(lambda: app.state.predictor.predict(decode_json_object(raw)))

    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return {"live": app.state.engine_metrics_source is not None, "lessons": list(api.LESSONS)}

    return app
