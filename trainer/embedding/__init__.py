"""The sparse side: sharding, shard store + sparse optimizers, the alltoall exchange, the module."""
from .exchange import LookupPlan, RowExchange, plan_lookup
from .module import HybridEmbedding
from .optim import make_sparse_optimizer
from .sharding import RowSharding
from .store import ShardStore, init_rows

__all__ = ["HybridEmbedding", "LookupPlan", "RowExchange", "RowSharding", "ShardStore",
           "init_rows", "make_sparse_optimizer", "plan_lookup"]
