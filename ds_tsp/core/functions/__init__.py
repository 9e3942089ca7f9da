"""The autograd Functions of the sharded layers (attention, MLP, embedding, LM head, RMSNorm), each with its
hand-written backward and comm schedule, and the flat weight-shard packing they move."""
