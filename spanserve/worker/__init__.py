"""What one rank executes: the KV storage it holds, the model runner and its CUDA graphs."""
