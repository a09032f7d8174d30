"""The checkpoint service: two-phase commit of globally consistent checkpoints, and retention."""
