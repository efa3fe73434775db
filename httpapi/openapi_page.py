"""GET /docs: the OpenAPI document as one HTML page with no external assets. vLLM serves Swagger
UI from a CDN; a server's clients may have no network beyond it, and a page that loads nothing
else cannot be made to run another site's script, so this page is plain HTML written from the
document: each route, its methods, and its body's fields with their types, defaults and bounds."""

from __future__ import annotations

import html
from typing import Any

import orjson

STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:70em}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}"
    "code{background:#f4f4f4}h2{font-size:1.1em;margin-top:2em}"
)


def docs_page(document: dict[str, Any], document_url: str) -> bytes:
    """The page of `document`; document_url: where the JSON is (under the server's --root-path)."""
    info = document["info"]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(info['title'])} API</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{_e(info['title'])} {_e(info['version'])}</h1><p>{_e(info['description'])}</p>",
        f"<p>The OpenAPI document: <a href='{_e(document_url)}'>{_e(document_url)}</a></p>",
    ]
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            parts.append(f"<h2><code>{method.upper()} {_e(path)}</code></h2><p>{_e(op['summary'])}</p>")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            for i, form in enumerate(body.get("anyOf", [body]) if body is not None else []):
                parts.append(f"<p>or, the body's form {i + 1}:</p>" if i else "")
                parts.append(_fields_table(form))
            statuses = ", ".join(op["responses"])
            parts.append(f"<p>Answers: {statuses}.</p>")
    parts.append("</body></html>")
    return "".join(parts).encode()


def _fields_table(schema: dict[str, Any], prefix: str = "") -> str:
    required = set(schema.get("required", ()))
    rows = []
    for name, field in schema.get("properties", {}).items():
        nested = next((s for s in field.get("anyOf", ()) if "properties" in s), None)
        facts = {k: field[k] for k in ("default", "minimum", "maximum", "enum") if k in field}
        rows.append(
            f"<tr><td><code>{_e(prefix + name)}</code></td><td>{_e(_type(field))}</td>"
            f"<td>{'yes' if name in required else ''}</td>"
            f"<td>{_e(', '.join(f'{k}: {orjson.dumps(v).decode()}' for k, v in facts.items()))}</td></tr>"
        )
        if nested is not None:
            rows.append(f"<tr><td colspan='4'>{_fields_table(nested, prefix + name + '.')}</td></tr>")
    head = "<tr><th>field</th><th>type</th><th>required</th><th>default, bounds, values</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _type(field: dict[str, Any]) -> str:
    """A field's JSON type as the page shows it; untyped: checked by the route's own code."""
    kind = field.get("type")
    if isinstance(kind, list):
        return " or ".join(k for k in kind if k != "null")
    if kind is not None:
        return kind
    if "anyOf" in field:
        return " or ".join(_type(s) for s in field["anyOf"] if s.get("type") != "null")
    return "any JSON (the route checks its shape)"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)
