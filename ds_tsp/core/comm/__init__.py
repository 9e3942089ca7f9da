"""Communication on the TSP axis: the communicator with its counters (communicator), the autograd
primitives built on it (primitives), the K/V gather straight into global order (kv_gather), a post-order recorder."""
