"""hpcdl: distributed deep-learning training over MPI with a Horovod-compatible torch API.

The torch layer is built on :mod:`collectives`; nothing happens on import (``init`` starts
the runtime and its background engine). ``import hpcdl as hvd`` gives Horovod's PyTorch
API: ranks and node layout, tensor collectives in their four forms, process sets, join,
broadcast helpers, compression, ``SyncBatchNorm`` and the timeline.
"""

from __future__ import annotations

from .startup import note_signals_while_starting

note_signals_while_starting()  # before torch and MPI load: the training job notes a Ctrl-C there

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hpcdl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

from .basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from .compression import Compression
from .config import Config
from .errors import HorovodInternalError, HpcdlArgumentError, HpcdlError, PipelineError
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters, empty
from .ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from .optim import DistributedOptimizer, HybridOptimizer, ZeroOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "__version__",
    "HpcdlError",
    "HpcdlArgumentError",
    "PipelineError",
    "HorovodInternalError",
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "is_homogeneous",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "nccl_built",
    "gloo_built",
    "gloo_enabled",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "Config",
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "poll",
    "synchronize",
    "barrier",
    "join",
    "start_timeline",
    "stop_timeline",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "broadcast_parameters",
    "empty",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
    "Compression",
    "SyncBatchNorm",
    "DistributedOptimizer",
    "ZeroOptimizer",
    "HybridOptimizer",
]
