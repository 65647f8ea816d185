"""`python -m pipeline deploy SPEC`: Kubernetes manifests and a session-affine proxy for a spec (docs/deploy.md)."""
