"""hybrid-trainer: data-parallel dense layers, model-parallel embedding tables (see README.md,
"Read these files first").

`__distribution__` marks this package and `kernels` as hybrid-trainer's: the import names
`trainer` and `kernels` are also used by other distributions (Coqui's trainer, Hugging Face's
kernels), and an install of one over the other mixes their files. trainer/run/install.py checks the
marks before a run starts and names what it found instead."""
__distribution__ = "hybrid-trainer"
