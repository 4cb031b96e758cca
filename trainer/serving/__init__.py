"""A trained run out of the trainer: `export` writes one artifact directory (the dense model as a
torch.export program, each table as one memory-mappable file, the data's preprocessing, a
manifest with every file's sha256); `Predictor` scores rows with it as the trainer's evaluation
does (docs/serving.md)."""
