"""The client flags of the commands that talk to a frontend (TLS, mutual TLS, API key), for `openengine-serve`
and the benchmark's `--target`. Importing it imports no gRPC: `openengine-serve health` must start fast."""

from __future__ import annotations

import argparse


def add_credential_arguments(parser: argparse.ArgumentParser) -> None:
    """Client flags for a secured frontend (TLS, mutual TLS, API key)."""
    parser.add_argument(
        "--tls",
        action="store_true",
        help="connect with TLS, verifying the server with the system's roots (implied by --tls-ca-file)",
    )
    parser.add_argument("--tls-ca-file", default="", help="PEM CA that signed the frontend's certificate")
    parser.add_argument("--tls-cert-file", default="", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key-file", default="", help="PEM key of --tls-cert-file")
    parser.add_argument(
        "--tls-server-name", default="", help="name expected in the frontend's certificate (default: the --target host)"
    )
    parser.add_argument(
        "--api-key", default="", help="API key, sent as `authorization: Bearer <key>` [OPENENGINE_API_KEY]"
    )


def uses_tls(args: argparse.Namespace) -> bool:
    """As client.Credentials.uses_tls, without importing grpc."""
    return bool(args.tls or args.tls_ca_file or args.tls_cert_file or args.tls_key_file)


def credentials(args: argparse.Namespace):
    from .client import Credentials

    return Credentials.from_env(
        tls=args.tls,
        ca_file=args.tls_ca_file,
        cert_file=args.tls_cert_file,
        key_file=args.tls_key_file,
        api_key=args.api_key,
        server_name=args.tls_server_name,
    )
