"""verify op: pure-jnp reference and Pallas kernels behind one api."""
