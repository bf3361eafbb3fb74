"""The OpenAI-compatible HTTP frontend: app factory, request validation, streaming, metrics."""

from infer_cli.http.app import ServerSettings, create_app, server_state

__all__ = ["ServerSettings", "create_app", "server_state"]
