"""The library core: config, topology, comm, partitioning, RoPE, documents, kernels and the sharded layers' autograd
Functions. It imports nothing above it (docs/architecture.md)."""
