"""openengine-serve: a serving stack for the OpenEngine (openengine.v1) gRPC protocol."""

__version__ = "0.1.0"
