"""Engine connectors: glue between an inference engine's KV cache and a KCaaS store (in process or remote)."""
