"""The library core, a folder a concept (bottom to top; each imports only its own folder and those below, which
tests/meta/test_layering.py checks): the root (config: the "tsp" block and TSPOptions; errors; version; deprecation;
activation offload), reliability/, comm/, parallel/, grads/, shape/, tokens/ and layers/ (the sharded layers'
autograd Functions). It imports nothing above it (docs/architecture.md)."""
