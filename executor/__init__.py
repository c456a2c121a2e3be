"""roseinfer.executor: the real executor (model runner, attention backends, KV cache,
CUDA graphs) that ``rose-run`` drives with the shared scheduler."""
