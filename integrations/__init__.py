"""roseinfer.integrations: roseinfer's policies inside other serving engines.

``roseinfer.integrations.vllm`` is a vLLM scheduler class (``--scheduler-cls``)
driven by a roseinfer admission policy; it needs the ``vllm`` extra. Nothing
else in roseinfer imports an engine.
"""
