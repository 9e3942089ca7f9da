"""The sharded nn.Modules of a TSP model: the decoder layer and its attention, MLP and vocab pieces (decoder), the MoE
block (moe), the Gated DeltaNet block (gated_deltanet), and the HF slices each piece reads (slices)."""
