"""The CPU backend: the kernels and one-time model rewrites that only the CPU path uses.

``prepare.prepare_cpu_model`` runs once, at load (``engine/loading.py``):
the draft's quantization (``int4.py``, ``int8.py``) and the prepacked oneDNN
linears of both models (``onednn.py``). The engine itself never rewrites a
model. Nothing on the CUDA path imports this package (checked by
``tests/unit/test_dependency_direction.py``), so a CUDA run never loads
CPU-only kernels.
"""
