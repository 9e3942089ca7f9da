"""The autograd Functions of the sharded layers, each with its hand-written backward and comm schedule: mlp and norm
here with the machinery they share (amp: autocast for custom Functions; weight_packing: one flat shard per rank
and layer; shard_rebuild: a shard rebuilt in backward instead of kept), and a folder per layer family: attention/,
moe/, linear_attention/, vocab/."""
