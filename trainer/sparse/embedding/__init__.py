"""The sparse side: sharding, shard store + sparse optimizers, the lookup plan and no-cache wire, the
remote-row protocols (remote/), the HET cache, replicas, the module."""
from .exchange import RowExchange, plan_lookup
from .module import HybridEmbedding
from .optim import make_sparse_optimizer
from .sharding import RowSharding, Sharding, flat_ids
from .store.shard import ShardStore, init_rows
from .types import GlobalStep, InFlightStep, LookupPlan, Pushes

__all__ = ["GlobalStep", "HybridEmbedding", "InFlightStep", "LookupPlan", "Pushes", "RowExchange", "RowSharding",
           "ShardStore", "Sharding", "flat_ids", "init_rows", "make_sparse_optimizer", "plan_lookup"]
