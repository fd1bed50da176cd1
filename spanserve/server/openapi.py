"""The OpenAPI document's request bodies.

Routes read their bodies as raw bytes and validate them with the pydantic models themselves (one
400 path for bad JSON, wrong types and refused fields), so FastAPI cannot infer the bodies; this
adds each route's model schema to /openapi.json, for /docs and for schema-driven clients and
fuzzers."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def body_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """A $ref to the model's schema, its definitions merged into `components`."""
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel] | dict[str, Any]]) -> None:
    """bodies: POST path -> its request model, or a plain JSON schema for bodies with no model."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, body in bodies.items():
                schema = body if isinstance(body, dict) else body_schema(body, components)
                doc["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": schema}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
