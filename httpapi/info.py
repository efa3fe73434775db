"""What the server says about itself: the served model's name and the 404 for any
other, /v1/models, SGLang's /get_model_info and /get_server_info."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import orjson

from httpapi.errors import APIError, bad_request, model_not_found

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(model_path: str | None, name: str | Sequence[str] | None = None) -> str:
    """The name responses report: the first of --served-model-name, else the model's directory
    or file name (no .gguf suffix)."""
    return served_model_names(model_path, name)[0]


def served_model_names(model_path: str | None, names: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """Every name the model answers to (--served-model-name takes several, as vLLM's does)."""
    if isinstance(names, str):
        names = (names,)
    if names:
        return tuple(names)
    if model_path is None:
        return (DEFAULT_MODEL_NAME,)
    path = Path(model_path.rstrip("/"))
    return (path.stem if path.suffix == ".gguf" else path.name,)


def check_model(model: str | None, served: Collection[str], adapters: Mapping[str, int] | None = None) -> int:
    """The LoRA adapter `model` names (its id; 0: the base model). No model means the served
    one (as vLLM and SGLang do); an adapter is named alone (vLLM's) or as `base:adapter`
    (SGLang's); any other name is a 404 that names it."""
    if model is None or model in served:
        return 0
    if adapters:
        if model in adapters:
            return adapters[model]
        base, sep, name = model.partition(":")
        if sep and base in served and name in adapters:
            return adapters[name]
    raise model_not_found(model)


def check_adapter(name: str | None, adapters: Mapping[str, int] | None) -> int:
    """/generate's lora_path: the adapter's id (None: the base model, 0); an unknown name is a
    404 that names it, a server without LoRA (`adapters` None) refuses the field."""
    if name is None:
        return 0
    if adapters is None:
        raise bad_request("lora_path: this server serves no LoRA adapters (start it with --enable-lora)", "lora_path")
    lid = adapters.get(name)
    if lid is None:
        raise APIError(404, f"The LoRA adapter `{name}` does not exist.", "lora_path", code="model_not_found")
    return lid


def model_card(served: str, created: int, context_len: int, root: str) -> dict:
    """The served model as GET /v1/models lists it and GET /v1/models/{id} returns it. `root`:
    the model every served name is (vLLM's field), by its name: a path would tell clients
    where the server keeps its files."""
    return {
        "id": served,
        "object": "model",
        "created": created,
        "owned_by": "ringserve",
        "root": root,
        "parent": None,
        "max_model_len": context_len,
    }


def adapter_card(name: str, created: int, context_len: int, parent: str) -> dict:
    """A LoRA adapter as /v1/models lists it."""
    return {**model_card(name, created, context_len, name), "parent": parent}


def models_body(served: Sequence[str], created: int, context_len: int, adapters: Sequence[str] = ()) -> bytes:
    """Every served name, the first first; each one's root is the first. Then each LoRA
    adapter, its `parent` the base model (vLLM's shape; its root is its name, not its path)."""
    cards = [model_card(name, created, context_len, served[0]) for name in served]
    cards += [adapter_card(name, created, context_len, served[0]) for name in adapters]
    return orjson.dumps({"object": "list", "data": cards})


def model_info_body(
    served: str,
    model_path: str,
    context_len: int,
    vocab_size: int,
    architecture: str,
    tokenizer_path: str | None = None,
) -> bytes:
    return orjson.dumps(
        {
            "model_path": model_path,
            "tokenizer_path": tokenizer_path or model_path,
            "served_model_name": served,
            "is_generation": True,
            "context_length": context_len,
            "vocab_size": vocab_size,
            "architectures": [architecture],
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "preferred_sampling_params": None,
        }
    )


def server_info_body(settings: Mapping[str, object], **state: object) -> bytes:
    """The server's settings (never the API key), the version, and whatever engine state
    the caller adds (e.g. max_total_num_tokens, internal_states)."""
    info = {k: v for k, v in settings.items() if k != "api_key"}
    info["version"] = server_version()
    info.update(state)
    return orjson.dumps(info)


def server_version() -> str:
    try:
        return version("ringserve")
    except PackageNotFoundError:
        return "unknown"
