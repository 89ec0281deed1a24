"""Sharded module types (tensor-parallel attention, tensor- and expert-parallel MoE) and ``shard_model``,
which turns a loaded single-process model into one rank's share of it."""
