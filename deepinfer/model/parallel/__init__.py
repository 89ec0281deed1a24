"""Sharded module types (tensor-parallel attention, tensor- and expert-parallel MoE), ``sharding_hook`` (the
loader's hook a rank loads only its slices with) and ``shard_model`` (the same cut of a model loaded whole)."""
