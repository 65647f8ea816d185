"""Speculative-decoding engine pipeline: YAML spec -> engines -> Triton repository -> gRPC -> reports."""

__version__ = "0.1.0"
