"""Tensor parallelism inside the engine: the layer set (``layers.py``), how a model splits
(``layout.py``), the collectives (``comm.py``) and the worker ranks rank 0 drives (``workers.py``)."""
from asyncrl.engine.parallel.layout import SINGLE, TensorParallel, TensorParallelError, check_tensor_parallel

__all__ = ["SINGLE", "TensorParallel", "TensorParallelError", "check_tensor_parallel"]
