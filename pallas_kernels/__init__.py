"""Pallas GPU kernels and, beside each, the pure-jnp reference it is tested against."""
