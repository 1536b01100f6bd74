"""A cost model that plans parallel deployments: memory, prefill/decode time, throughput and TTFT of
every DP x TP x PP x CP layout of a model on a cluster (see docs/planning.md)."""

from scratchlm.plan.cluster import ClusterSpec, load_cluster
from scratchlm.plan.cost import Layout, Prediction, Workload, enumerate_layouts, explain, plan, predict

__all__ = ["ClusterSpec", "Layout", "Prediction", "Workload", "enumerate_layouts", "explain", "load_cluster",
           "plan", "predict"]
