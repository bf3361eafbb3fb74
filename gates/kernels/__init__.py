"""GPU gates for the kernels suite (manifests/kernels.toml)."""
