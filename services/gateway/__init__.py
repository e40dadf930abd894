"""The gateway: OpenAI-compatible HTTP in front of prefill/decode pairs and colocated workers.

A request's path through the package:

    app.py (FastAPI)  ->  routes_openai.py / routes_native.py   parse, validate (errors.py)
                      ->  model_files.py + chat_template.py      prompt text -> token ids
                      ->  dispatcher.py                          retries, abort, metrics
                      ->  router.py + policies/                  pick (prefill, decode)
                      ->  workers.py (WorkerPool, gRPC stubs)    filled by discovery.py

The gateway never imports torch (nor transformers, engine or libkv): tokenization uses the
`tokenizers` library and the chat template is rendered with jinja2 as transformers does.
"""
