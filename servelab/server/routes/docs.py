"""/openapi.json and the Swagger UI at /docs, behind the same API key as the rest of the API."""

from __future__ import annotations

import swagger_ui_bundle
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles

router = APIRouter(include_in_schema=False)


@router.get("/openapi.json")
async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def docs() -> Response:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="servelab API",
        swagger_js_url="/docs/static/swagger-ui-bundle.js",
        swagger_css_url="/docs/static/swagger-ui.css",
        swagger_favicon_url="/docs/static/favicon-32x32.png",
    )


def mount_docs_static(app: FastAPI) -> None:
    """Swagger UI's files come from a package, not a CDN: the page works on a machine offline.
    A router cannot carry a mount, so the app factory calls this next to including `router`."""
    app.mount("/docs/static", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger-ui")
