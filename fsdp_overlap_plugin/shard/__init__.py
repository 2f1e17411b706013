"""Compile-visible FSDP2: sharding, activation checkpointing, initialization, weights in and out, checkpoints, transformers specifics."""
