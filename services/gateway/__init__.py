"""The gateway: OpenAI-compatible HTTP in front of prefill/decode pairs and colocated workers.

A request's path through the package:

    middleware.py   ASGI: count, 500 on a bug, body size and time (413/408), API key (401)
    routes.py       the endpoint: the body (protocol.py, errors.py), fan-out (400) and admission
                    (429, middleware.RequestGuards), one SamplingParams per choice (protocol.py)
    prompts.py      chat template + tokenizer: prompt text -> token ids, checked against the model
    responses.py    run the choices and merge their chunks (each timed by its RequestTimer);
                    answer whole or as server-sent events
    dispatcher.py   one generation: route, Worker.Generate, retries, abort, migration
    migration.py    a generation whose decode failed mid-stream, continued on another pair
    workers.py      Router + policies/ pick (prefill, decode) among the WorkerPool's workers,
                    whose circuit breakers say which may take traffic

Beside the path: app.py builds the FastAPI app around a GatewayState (state.py) made from the
flags (config.py); discovery.py fills the pool (static workers, the registry, health probes),
model_source.py learns the model from the workers when there is no --model-path, kv_events.py
follows the workers' prefix caches for cache_aware (kv_view.py), openapi.py fixes the document.

The gateway never imports torch (nor transformers, engine or libkv): tokenization uses the
`tokenizers` library and the chat template is rendered with jinja2 as transformers does.
"""
