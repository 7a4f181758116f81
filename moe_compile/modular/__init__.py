"""The modular kernel (seed 000): PrepareAndFinalize x PermuteExpertsUnpermute x TopKWeightAndReduce."""
from moe_compile.modular.base import (
    ActivationFormat,
    ExpertTokensMetadata,
    ExpertWeights,
    PermuteExpertsUnpermute,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduce,
    WorkspaceShapes,
)
from moe_compile.modular.experts import BatchedExperts, GroupedExperts, ReferenceExperts
from moe_compile.modular.kernel import ModularKernel, check_compatible
from moe_compile.modular.prepare_finalize import BatchedPrepareAndFinalize, StandardPrepareAndFinalize
from moe_compile.modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
    TopKWeightAndReduceNoOp,
)

__all__ = [
    "ActivationFormat", "BatchedExperts", "BatchedPrepareAndFinalize", "ExpertTokensMetadata",
    "ExpertWeights", "GroupedExperts", "ModularKernel", "PermuteExpertsUnpermute",
    "PrepareAndFinalize", "PrepareResult", "ReferenceExperts", "StandardPrepareAndFinalize",
    "TopKWeightAndReduce", "TopKWeightAndReduceContiguous", "TopKWeightAndReduceDelegate",
    "TopKWeightAndReduceNaiveBatched", "TopKWeightAndReduceNoOp", "WorkspaceShapes", "check_compatible",
]
