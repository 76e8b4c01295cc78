"""Data parallelism over ``torch.distributed``: the process group, chunk shards per rank, and the
averaging of replicated parameters' gradients."""
