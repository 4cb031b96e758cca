"""Tier 3, the step: TrainPipeline (pipeline.py), the one owner of a step's order, state and clock;
its strategies (the eager step, eager.py; the graph steps, dense_step.py, whole_step.py,
padded_step.py); the dense optimizer's graph (dense_update.py); precision and the lr schedule.
It calls the sparse side through HybridEmbedding and never assembles anything itself."""
