"""Where tokens live and what they carry: the zigzag layout (zigzag), packed documents (documents), RoPE on global
positions (rope, positions), the model's input check across cp (input_check) and the data loader (loader)."""
