"""The gRPC front: ``sluice.v1.Streams`` over the same runtime as the HTTP API
(:mod:`~sluice.grpc_api.server`, :mod:`~sluice.grpc_api.service`)."""
