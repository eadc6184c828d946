"""Pure-Python scheduling and KV-cache bookkeeping. Imports no JAX."""
