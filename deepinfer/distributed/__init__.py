"""Parallelism over torch.distributed: the parallel configuration, the process world and its groups, and the
collectives the sharded modules (``deepinfer/model/parallel/``) call."""
