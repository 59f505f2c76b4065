"""The OpenAI-compatible HTTP API of the frontend (OPENENGINE_HTTP_PORT), beside openengine.v1 on gRPC."""
