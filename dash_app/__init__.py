"""The kforge dashboard (`kforge dash RUN_DIR...`): reads search logs and .cast packages, never writes."""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
