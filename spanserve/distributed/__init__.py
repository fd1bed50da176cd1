"""Tensor parallelism: one driver process (scheduler, cache manager, keys, sampling, and rank 0's
shard of the model) and N-1 worker processes, each holding a slice of the heads and MLP columns,
joined by torch.distributed (NCCL on CUDA, gloo on the CPU)."""
