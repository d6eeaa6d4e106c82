"""The wire-API registry: each API the server speaks is a `WireApi` (its FastAPI router, the paths whose errors take
its shape, how it shapes an error) registered with `register_api` by its own module. The app includes every
registered API; an error on a path no API claims takes the default API's shape (OpenAI's).

Adding a wire API is one module (routes, answer shapes and a `register_api` call, its request bodies beside) and
one name in `serving/api/catalog.py`'s `BUILT_IN`, or a plug-in module (tasks/plugins.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import APIRouter

# (HTTP status, message, kind) → the JSON body of an error, in the API's own shape
ErrorBody = Callable[[int, str, str], dict]


@dataclass(frozen=True)
class WireApi:
    name: str
    router: APIRouter
    error_body: ErrorBody
    routes: frozenset[str] = field(default_factory=frozenset)  # paths whose errors take this API's shape
    default: bool = False  # errors on paths no API claims take this shape (one API is the default)


APIS: dict[str, WireApi] = {}


def register_api(api: WireApi) -> WireApi:
    """Add `api` under its name (a second, different API of the same name is an error)."""
    if api.name in APIS and APIS[api.name] != api:
        raise ValueError(f"wire API {api.name!r} is registered twice")
    APIS[api.name] = api
    return api


def error_shape(path: str | None) -> ErrorBody:
    """The error body of the API that claims `path`, else the default API's."""
    claimed = [api for api in APIS.values() if path in api.routes]
    return (claimed or [api for api in APIS.values() if api.default])[0].error_body
