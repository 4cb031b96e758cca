"""hybrid-trainer: data-parallel dense layers, model-parallel embedding tables (see README.md,
"Read these files first")."""
