"""The API docs page (``/docs``) with Swagger UI served from the package, not a CDN.

FastAPI's default ``/docs`` loads its JavaScript and CSS from jsdelivr, so on a machine without
internet it renders a blank page. The assets come from ``swagger-ui-bundle`` (the Swagger UI
distribution packaged for Python) and are served under ``/docs/static``; this follows FastAPI's
documented self-hosting recipe ("Custom Docs UI Static Assets").
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_PREFIX = "/docs/static"


def add_docs_page(app: FastAPI) -> None:
    """Serve ``/docs`` (Swagger UI over ``app.openapi_url``) and its assets from the package.
    The app must be built with ``docs_url=None`` so FastAPI's CDN page is not registered."""
    from swagger_ui_bundle import swagger_ui_path

    app.mount(STATIC_PREFIX, StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - API docs",
                                   oauth2_redirect_url="/docs/oauth2-redirect",
                                   swagger_js_url=f"{STATIC_PREFIX}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{STATIC_PREFIX}/swagger-ui.css",
                                   swagger_favicon_url=f"{STATIC_PREFIX}/favicon-32x32.png")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
