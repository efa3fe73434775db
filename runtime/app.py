"""The ASGI entry point: `granian --interface asgi runtime.app:app [--workers N]`.

Each granian worker runs the app's lifespan: it starts the engine or attaches to the one
another worker started (runtime/supervise/launcher.py), takes a worker index, connects its
REQUEST and TEXT_OUT channels and runs its HTTPWorkerProcess (runtime/http_worker/main.py). Settings
come from RINGSERVE_* environment variables (ServerArgs.from_env; `python -m runtime serve`
sets them from its flags).
"""

from runtime.http_worker.asgi import App
from runtime.http_worker.decisions_routes import DECISIONS_ROUTES
from runtime.http_worker.engine_routes import ENGINE_ROUTES
from runtime.http_worker.lora_routes import LORA_ROUTES
from runtime.http_worker.pooling_routes import POOLING_ROUTES
from runtime.http_worker.responses_routes import RESPONSE_ITEM_ROUTES, RESPONSES_PATH, RESPONSES_ROUTES
from runtime.http_worker.routes import ROUTES, retrieve_model

app = App(
    {**ROUTES, **RESPONSES_ROUTES, **ENGINE_ROUTES, **LORA_ROUTES, **POOLING_ROUTES, **DECISIONS_ROUTES},
    model_card=retrieve_model,
    prefixes={RESPONSES_PATH + "/": RESPONSE_ITEM_ROUTES},
)
