"""vLLM's gRPC engine protocol (``vllm.grpc.engine.VllmEngine``), both sides of it.

:mod:`~sluice.vllm_grpc.proto` is the protocol itself, the messages of the PyPI package
``smg-grpc-proto``; :mod:`~sluice.vllm_grpc.servicer` serves the embedded engine over it
(``sluice worker``, run by :mod:`~sluice.vllm_grpc.worker`); the gateway's client is the
backend :mod:`sluice.backends.worker`. :mod:`~sluice.vllm_grpc.tokenizer_bundle` carries a
model's tokenizer and chat template from a worker to the gateway (``GetTokenizer``).
"""
