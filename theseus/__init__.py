"""theseus: annotate a model once with logical axis names, train it under DP, TP, ZeRO or FSDP."""

from theseus.base.axis import Axis, ShardingPlan, ShardingPolicy, partition_spec
from theseus.base.topology import Topology

__all__ = ["Axis", "ShardingPlan", "ShardingPolicy", "Topology", "partition_spec"]
