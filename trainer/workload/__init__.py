"""Tier 1, what is trained: batches from every source (data/: synthetic presets, prepared Criteo
blocks, MovieLens; their shapes, vocabularies and orders) and the dense models (models/: DLRM,
Wide&Deep, DeepFM, DCN), single-device nn.Modules with no parallelism of their own."""
