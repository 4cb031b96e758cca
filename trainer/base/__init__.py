"""Tier 0, the foundation every other tier stands on: the config's schema, loading and checks
(config/, a leaf: it imports nothing else of the package), the small helpers every component
shares (core/: errors and phases, device and disk facts, hashing, progress, atomic files, this
process's stop signals) and the collectives (comm/: local, torch.distributed, Horovod)."""
