"""``rose-serve``: an OpenAI-compatible HTTP server over the streaming executor.

``protocol`` turns request bodies into engine arguments (400 naming the field),
``app`` holds the FastAPI routes and the SSE streams, ``metrics`` the Prometheus
collectors, ``tokenizer`` the synthetic word tokenizer of built-in models, and
``cli`` the command line.
"""
